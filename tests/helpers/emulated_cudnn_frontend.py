"""CPU emulation of nvidia-cudnn-frontend's SDPA torch ops `cudnn::sdpa_fwd` / `cudnn::sdpa_bwd`.

Where it sits: test support for `ops/backends/cudnn_frontend.py`. The schemas are the ones the
1.32.0 wheel registers (`cudnn/sdpa/fwd/torch_op.py`, copied below; each call is bound against
them), and so are the semantics the adapter relies on: THD q/k/v with cumulative lengths, GQA;
cuDNN's diagonal band -- `window_left` = lb keeps key j of row i when j > i - lb, `window_right`
= rb keeps j <= i + rb, `is_causal` is rb = 0 and refused with rb > 0, `causal_bottom_right`
anchors the band at each sequence's last row and key (top-left otherwise) and is refused without
a band; the forward returns the LSE [T, H, 1] float32; the backward refuses an LSE that is not
the PADDED [B, H, max_seqlen_q(, 1)] float32 layout and reads only each sequence's rows of it.
"""

from __future__ import annotations

import types

import torch

from tests.helpers.emulated_backends import _Sim

FWD_SCHEMA = (
    "cudnn::sdpa_fwd(Tensor q, Tensor k, Tensor v, float attn_scale, "
    "bool is_causal=False, bool causal_bottom_right=False, int window_left=-1, int window_right=-1, "
    "Tensor? sinks=None, Tensor? seq_len_q=None, Tensor? seq_len_kv=None, "
    "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_kv=None, int max_seqlen_q=0, int max_seqlen_kv=0, "
    "bool return_lse=True) -> (Tensor, Tensor)"
)
BWD_SCHEMA = (
    "cudnn::sdpa_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, float attn_scale, "
    "bool is_causal=False, bool causal_bottom_right=False, int window_left=-1, int window_right=-1, "
    "Tensor? sinks=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_kv=None, int max_seqlen_q=0, "
    "int max_seqlen_kv=0, bool is_deterministic=False) -> (Tensor, Tensor, Tensor)"
)


def _band(sim: _Sim, is_causal: bool, causal_bottom_right: bool, window_left: int, window_right: int):
    """The op's band checks, then (left, right) in flash-attn's terms for the simulator."""
    if causal_bottom_right and not (is_causal or window_left >= 0 or window_right >= 0):
        raise ValueError("causal_bottom_right only re-anchors an active diagonal band; set is_causal, window_left or window_right too")
    if is_causal and window_right > 0:
        raise ValueError(f"is_causal masks every future column but window_right={window_right} admits some; pass one or the other")
    if 0 <= window_left < 1:
        raise ValueError(f"sliding-window length must be >= 1; got {window_left}")
    sim.top_left = not causal_bottom_right
    return (window_left - 1 if window_left >= 0 else -1), (0 if is_causal else window_right)


def _bind(schema: str, fn):
    """`fn` as a torch op to the adapter: every call bound against the schema's names and defaults."""
    parsed = torch._C.parse_schema(schema)
    names = [a.name for a in parsed.arguments]
    defaults = {a.name: a.default_value for a in parsed.arguments if a.default_value is not None or a.type.kind() == "OptionalType"}

    def op(*args, **kwargs):
        if len(args) > len(names) or set(kwargs) - set(names) or set(names[: len(args)]) & set(kwargs):
            raise TypeError(f"{parsed.name}() got arguments {len(args)} positional, {sorted(kwargs)} that do not bind to {schema}")
        bound = dict(zip(names, args), **kwargs)
        missing = [n for n in names if n not in bound and n not in defaults]
        if missing:
            raise TypeError(f"{parsed.name}() missing {missing}")
        return fn(**{n: bound.get(n, defaults.get(n)) for n in names})

    return _Op(op, types.SimpleNamespace(_schema=parsed))


def frontend_ops(*, allow_float64: bool = False):
    """(`torch.ops.cudnn` stand-in with `sdpa_fwd` / `sdpa_bwd`, the simulator)."""
    sim = _Sim(allow_float64)

    def sdpa_fwd(q, k, v, attn_scale, is_causal, causal_bottom_right, window_left, window_right, sinks, seq_len_q,
                 seq_len_kv, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, return_lse):
        assert sinks is None and seq_len_q is None and seq_len_kv is None and return_lse and q.dim() == 3
        left, right = _band(sim, is_causal, causal_bottom_right, window_left, window_right)
        out, lse = sim.forward(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, attn_scale, False,
                               left, right, None)
        return out, lse.t().contiguous().unsqueeze(-1)  # [T, H, 1]

    def sdpa_bwd(grad_out, q, k, v, o, lse, attn_scale, is_causal, causal_bottom_right, window_left, window_right, sinks,
                 cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, is_deterministic):
        assert sinks is None
        b = cu_seqlens_q.numel() - 1
        if lse.dtype not in (torch.float32, torch.float64) or tuple(lse.shape[:3]) != (b, q.shape[1], max_seqlen_q):
            raise ValueError(f"lse must be the padded (B, H, max_seqlen_q) = {(b, q.shape[1], max_seqlen_q)} fp32, got {tuple(lse.shape)}")
        left, right = _band(sim, is_causal, causal_bottom_right, window_left, window_right)
        cu = cu_seqlens_q.long()
        token = torch.arange(q.shape[0])
        seq = torch.searchsorted(cu[1:], token, right=True)
        packed = lse.reshape(b, q.shape[1], max_seqlen_q)[seq, :, token - cu[seq]].t()  # [H, T]: each sequence's rows only
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        sim.backward(grad_out, q, k, v, o, packed, dq, dk, dv, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                     attn_scale, False, left, right, None, True)
        return dq, dk, dv

    return types.SimpleNamespace(sdpa_fwd=_bind(FWD_SCHEMA, sdpa_fwd), sdpa_bwd=_bind(BWD_SCHEMA, sdpa_bwd)), sim


class _Op:
    """A callable with `.default._schema`, as a registered torch op."""

    def __init__(self, call, default):
        self._call, self.default = call, default

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)
