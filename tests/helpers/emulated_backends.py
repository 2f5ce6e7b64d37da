"""CPU emulations of the external varlen attention APIs our adapters call.

Where it sits: test support for `ops/backends/` (tests/unit/test_backends.py). Each
emulation has the EXACT Python signature and return convention of the real entry point
(flash-attn v2.6.0/2.6.0.post1, v2.6.1, v2.6.2-2.6.3, v2.7.0-2.7.3, v2.7.4+/2.8.x `_flash_attn_varlen_forward/_backward`, read
from the tags of Dao-AILab/flash-attention; torch 2.11 / 2.13 `aten::_flash_attention_forward/
_backward`, checked against the installed schema by a test) and the kernel semantics the
adapters rely on: cumulative lengths, bottom-right aligned causal and (left, right)
windows (-1 = unbounded; causal forces right = 0), softcap, GQA, lse [H, total_q] float32
with +inf for a row with no key, backward from the given out/lse writing dq/dk/dv, and
a dq that changes run to run unless the backward is deterministic (flash-attn's
`deterministic` argument; torch's op reads `torch.use_deterministic_algorithms`).
It also enforces the C++ checks (dtype fp16/bf16, int32 cu_seqlens, head dim % 8 and
<= 256, contiguous last dim) so a wiring error fails on CPU. `allow_float64=True` lifts
the dtype check so wiring tests can compare at float64 precision.

Computation is dense per sequence in float32 (float64 for float64): a reference, not a
kernel; `calls` counts invocations for the dispatch tests.
"""

from __future__ import annotations

import inspect
import os
import types

import torch

from hf_longctx.ops.backends import flash_attn as fa_adapter
from hf_longctx.ops.backends import torch_flash as tf_adapter
from hf_longctx.ops.backends.select import KernelEnv


class _Sim:
    def __init__(self, allow_float64: bool, top_left: bool = False):
        self.allow_float64 = allow_float64
        self.top_left = top_left  # cuDNN's varlen causal flag: aligned to each sequence's first row and key
        self.calls = {"forward": 0, "backward": 0}
        self.deterministic: list[bool] = []  # what each backward call was told
        self._jitter = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))  # differs per run

    def check(self, q, k, v, cu_q, cu_k, max_q, max_k, window):
        ok = (torch.float16, torch.bfloat16) + ((torch.float64,) if self.allow_float64 else ())
        if q.dtype not in ok or k.dtype != q.dtype or v.dtype != q.dtype:
            raise RuntimeError(f"FlashAttention only support fp16 and bf16 data type, got {q.dtype} {k.dtype} {v.dtype}")
        if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2]:
            raise RuntimeError(f"varlen q/k/v must be [total, H, D], got {q.shape} {k.shape} {v.shape}")
        if q.shape[1] % k.shape[1] or q.shape[2] % 8 or q.shape[2] > 256:
            raise RuntimeError(f"bad heads / head dim: q {q.shape}, k {k.shape}")
        if any(x.stride(-1) != 1 for x in (q, k, v)):
            raise RuntimeError("Input tensor must have contiguous last dimension")
        for cu, total, mx in ((cu_q, q.shape[0], max_q), (cu_k, k.shape[0], max_k)):
            if cu.dtype != torch.int32 or cu.device != q.device or int(cu[-1]) != total or cu.dim() != 1:
                raise RuntimeError(f"cu_seqlens must be int32 on {q.device} ending at {total}, got {cu}")
            if not isinstance(mx, int) or int((cu[1:] - cu[:-1]).max()) > mx:
                raise RuntimeError(f"max_seqlen {mx!r} below a sequence length of {cu}")
        if len(cu_q) != len(cu_k):
            raise RuntimeError("cu_seqlens_q and cu_seqlens_k hold different batch sizes")
        if any(not isinstance(w, int) or w < -1 for w in window):
            raise RuntimeError(f"window sizes must be ints >= -1, got {window}")

    @staticmethod
    def unbounded(left, right, max_k):
        """flash_api.cpp (mha_varlen_fwd / mha_varlen_bwd, flash-attn 2.x and torch's copy):
        a window side >= max_seqlen_k becomes -1, unbounded."""
        return (-1 if left >= max_k else left), (-1 if right >= max_k else right)

    def scores(self, qs, ks, scale, causal, left, right, softcap):
        """s [H, nq, nk] (masked to -inf) and tanh term, bottom-right aligned (top-left under `top_left`)."""
        acc = torch.float64 if qs.dtype == torch.float64 else torch.float32
        h, hkv = qs.shape[1], ks.shape[1]
        kx = ks.to(acc).repeat_interleave(h // hkv, 1)  # [nk, H, D]
        s = torch.einsum("qhd,khd->hqk", qs.to(acc), kx) * scale
        t = None
        if softcap:
            t = torch.tanh(s / softcap)
            s = softcap * t
        nq, nk = qs.shape[0], ks.shape[0]
        r, c = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
        right = 0 if causal else right
        shift = 0 if self.top_left else nk - nq
        allowed = torch.ones(nq, nk, dtype=torch.bool)
        if right >= 0:
            allowed &= c <= r + shift + right
        if left >= 0:
            allowed &= c >= r + shift - left
        return s.masked_fill(~allowed, float("-inf")), t

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, left, right, softcap):
        self.check(q, k, v, cu_q, cu_k, max_q, max_k, (left, right))
        left, right = self.unbounded(left, right, max_k)
        self.calls["forward"] += 1
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = torch.zeros(q.shape, dtype=acc)
        lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float32 if acc == torch.float32 else acc)
        h, hkv = q.shape[1], k.shape[1]
        for i in range(len(cu_q) - 1):
            a, b, c0, c1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
            if b == a:
                continue
            s, _ = self.scores(q[a:b], k[c0:c1], scale, causal, left, right, softcap)
            l = torch.logsumexp(s, -1)  # [H, nq]
            p = torch.exp(s - l.masked_fill(torch.isneginf(l), 0).unsqueeze(-1))
            out[a:b] = torch.einsum("hqk,khd->qhd", p, v[c0:c1].to(acc).repeat_interleave(h // hkv, 1))
            lse[:, a:b] = l.masked_fill(torch.isneginf(l), float("inf")).to(lse.dtype)  # flash: +inf for an empty row
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, scale, causal, left, right, softcap,
                 deterministic=True):
        """`deterministic=False` is the kernels' atomic dq accumulation: its order, hence the
        last bits of dq, changes from run to run -- emulated by a random +-1 ulp on some
        elements, so a caller that fails to ask for the ordered path is caught by a
        run-to-run comparison."""
        self.check(q, k, v, cu_q, cu_k, max_q, max_k, (left, right))
        self.deterministic.append(bool(deterministic))
        left, right = self.unbounded(left, right, max_k)
        if out.dtype != q.dtype or dout.dtype != q.dtype or dout.shape != q.shape or out.shape != q.shape:
            raise RuntimeError(f"out/dout must be {q.dtype} {tuple(q.shape)}, got {out.dtype} {dout.dtype} {out.shape}")
        if lse.dtype not in (torch.float32, torch.float64) or tuple(lse.shape) != (q.shape[1], q.shape[0]):
            raise RuntimeError(f"softmax_lse must be float32 [H, total_q] = {(q.shape[1], q.shape[0])}, got {lse.dtype} {tuple(lse.shape)}")
        for g, x in ((dq, q), (dk, k), (dv, v)):
            if g is None or g.shape != x.shape or g.dtype != x.dtype:
                raise RuntimeError(f"dq/dk/dv must be preallocated like q/k/v, got {None if g is None else g.shape}")
        self.calls["backward"] += 1
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        h, hkv = q.shape[1], k.shape[1]
        gq, gk, gv = (torch.zeros(x.shape, dtype=acc) for x in (q, k, v))
        for i in range(len(cu_q) - 1):
            a, b, c0, c1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
            if b == a:
                continue
            s, t = self.scores(q[a:b], k[c0:c1], scale, causal, left, right, softcap)
            p = torch.exp(s - lse[:, a:b].to(acc).unsqueeze(-1))  # [H, nq, nk]; lse +inf -> 0
            do, o = dout[a:b].to(acc), out[a:b].to(acc)
            vx = v[c0:c1].to(acc).repeat_interleave(h // hkv, 1)
            kx = k[c0:c1].to(acc).repeat_interleave(h // hkv, 1)
            ds = p * (torch.einsum("qhd,khd->hqk", do, vx) - (do * o).sum(-1).T.unsqueeze(-1))
            if t is not None:
                ds = ds * (1 - t * t)
            gq[a:b] = torch.einsum("hqk,khd->qhd", ds, kx) * scale
            gk[c0:c1] = torch.einsum("hqk,qhd->khd", ds, q[a:b].to(acc)).unflatten(1, (hkv, h // hkv)).sum(2) * scale
            gv[c0:c1] = torch.einsum("hqk,qhd->khd", p, do).unflatten(1, (hkv, h // hkv)).sum(2)
        dq.copy_(gq), dk.copy_(gk), dv.copy_(gv)
        if not deterministic and dq.numel():
            flip = torch.rand(dq.shape, generator=self._jitter) < 0.25
            dq.copy_(torch.where(flip.to(dq.device), torch.nextafter(dq, torch.full_like(dq, float("inf"))), dq))


def _custom_op(fn):
    """What a torch custom op looks like to `inspect.signature`: (*args, **kwargs)."""
    def op(*args, **kwargs):
        return fn(*args, **kwargs)
    return op


_FWD_27 = (
    "flash_attn::_flash_attn_varlen_forward(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
    "SymInt max_seqlen_q, SymInt max_seqlen_k, float dropout_p, float softmax_scale, bool causal, "
    "SymInt window_size_left=-1, SymInt window_size_right=-1, float softcap=0., Tensor? alibi_slopes=None, "
    "bool return_softmax=False, Tensor? block_table=None, Tensor? leftpad_k=None, Tensor? seqused_k=None{extra}) "
    "-> (Tensor, Tensor, Tensor, Tensor)"
)
_BWD_27 = (
    "flash_attn::_flash_attn_varlen_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
    "Tensor(a!)? dq, Tensor(b!)? dk, Tensor(c!)? dv, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
    "SymInt max_seqlen_k, float dropout_p, float softmax_scale, bool causal, SymInt window_size_left, "
    "SymInt window_size_right, float softcap, Tensor? alibi_slopes, bool deterministic, Tensor? rng_state=None{extra}) -> Tensor"
)


def flash_attn_release(version: str, *, allow_float64: bool = False, schema_without_window: bool = False):
    """(version, flash_attn_interface stub, torch.ops.flash_attn stub or None, simulator)
    shaped like the given flash-attn release."""
    sim = _Sim(allow_float64)
    release = tuple(int(p) for p in version.split(".")[:3] if p.isdigit())
    iface = types.ModuleType("flash_attn.flash_attn_interface")
    if release < (2, 7):
        def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                    window_size, softcap, alibi_slopes, return_softmax, block_table):
            assert dropout_p == 0.0 and not return_softmax and alibi_slopes is None and block_table is None
            out, lse = sim.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                   causal, window_size[0], window_size[1], softcap)
            return out, q, k, v, out, lse, None, torch.empty(2, dtype=torch.int64)

        # The three Python signatures of the 2.6 line (tags v2.6.0 / v2.6.0.post1, v2.6.1, v2.6.2+):
        if release < (2, 6, 1):  # everything positional, block_table REQUIRED, no leftpad_k / seqused_k
            def _flash_attn_varlen_forward(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                window_size, softcap, alibi_slopes, return_softmax, block_table,
            ):
                return forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax, block_table)
        elif release < (2, 6, 2):  # block_table optional, leftpad_k added; window/softcap/... still required
            def _flash_attn_varlen_forward(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                window_size, softcap, alibi_slopes, return_softmax, block_table=None, leftpad_k=None,
            ):
                assert leftpad_k is None
                return forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax, block_table)
        else:
            def _flash_attn_varlen_forward(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_softmax=False, block_table=None,
                leftpad_k=None, seqused_k=None,
            ):
                assert leftpad_k is None and seqused_k is None
                return forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax, block_table)

        def _flash_attn_varlen_backward(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, rng_state=None,
        ):
            sim.backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, softmax_scale, causal, window_size[0], window_size[1], softcap, deterministic)
            return dq, dk, dv, torch.empty(0)

        iface._flash_attn_varlen_forward, iface._flash_attn_varlen_backward = _flash_attn_varlen_forward, _flash_attn_varlen_backward
        return version, iface, None, sim
    zero = release >= (2, 7, 4)

    def fwd(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
        block_table=None, leftpad_k=None, seqused_k=None, **zero_tensors,
    ):
        if set(zero_tensors) - ({"zero_tensors"} if zero else set()):
            raise TypeError(f"unexpected keyword arguments {sorted(zero_tensors)}")
        out, lse = sim.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                               window_size_left, window_size_right, softcap)
        return out, lse, torch.empty(0), torch.empty(2, dtype=torch.int64)

    def bwd(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
        rng_state=None, **zero_tensors,
    ):
        if set(zero_tensors) - ({"zero_tensors"} if zero else set()):
            raise TypeError(f"unexpected keyword arguments {sorted(zero_tensors)}")
        sim.backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, softmax_scale, causal, window_size_left, window_size_right, softcap, deterministic)
        return torch.empty(0)

    iface._flash_attn_varlen_forward, iface._flash_attn_varlen_backward = _custom_op(fwd), _custom_op(bwd)
    extra = ", bool zero_tensors=False" if zero else ""
    fwd_schema = _FWD_27.format(extra=extra)
    if schema_without_window:
        fwd_schema = fwd_schema.replace("SymInt window_size_left=-1, SymInt window_size_right=-1, ", "")
    ops = types.SimpleNamespace(
        _flash_attn_varlen_forward=types.SimpleNamespace(default=types.SimpleNamespace(_schema=torch._C.parse_schema(fwd_schema))),
        _flash_attn_varlen_backward=types.SimpleNamespace(default=types.SimpleNamespace(_schema=torch._C.parse_schema(_BWD_27.format(extra=extra)))),
    )
    return version, iface, ops, sim


class TorchFlashOps:
    """`torch.ops.aten._flash_attention_forward/_backward` on CPU with the installed torch's
    signatures (2.13 below; 2.11 lacks `block_table` / `num_splits`); `.default._schema` are
    the installed torch's real schemas."""

    def __init__(self, *, allow_float64: bool = False):
        self.sim = _Sim(allow_float64)
        sim = self.sim

        def forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
                    scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
                    block_table=None, num_splits=None):
            assert dropout_p == 0.0 and not return_debug_mask and cum_seq_q is not None
            left = -1 if window_size_left is None else window_size_left
            right = -1 if window_size_right is None else window_size_right
            out, lse = sim.forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
                                   scale if scale is not None else query.shape[-1] ** -0.5, is_causal, left, right, None)
            return out, lse, torch.zeros(2, dtype=torch.uint64), torch.empty(0), torch.empty(0)

        def backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                     is_causal, rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None):
            assert isinstance(rng_state, torch.Tensor) and isinstance(unused, torch.Tensor)
            dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
            left = -1 if window_size_left is None else window_size_left
            right = -1 if window_size_right is None else window_size_right
            # torch's own flash backward reads the global flag (deterministic unless warn_only)
            ordered = torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
            sim.backward(grad_out, query, key, value, out, logsumexp, dq, dk, dv, cum_seq_q, cum_seq_k, max_q, max_k,
                         scale, is_causal, left, right, None, ordered)
            return dq, dk, dv

        self.forward = _as_installed(forward, torch.ops.aten._flash_attention_forward.default)
        self.backward = _as_installed(backward, torch.ops.aten._flash_attention_backward.default)


def _as_installed(fn, overload):
    """`fn` restricted to the arguments the installed op's schema has (torch 2.11's forward
    lacks torch 2.13's `block_table` / `num_splits`): passing one it lacks is a TypeError,
    as with the real op. `.default` is the real overload (its `_schema` for `detect`)."""
    names = {a.name for a in overload._schema.arguments}
    full = inspect.signature(fn)
    sig = full.replace(parameters=[p for p in full.parameters.values() if p.name in names])

    def op(*args, **kwargs):
        sig.bind(*args, **kwargs)
        return fn(*args, **kwargs)

    op.__signature__, op.default = sig, overload
    return op


def cuda_env(*, flash: str | None = "2.8.3", torch_ops: bool = True, capability=(9, 0), torch_impl=None,
             allow_float64: bool = False, cudnn: str | None = None, cudnn_version: int = 91400, frontend: bool = False):
    """A `KernelEnv` as `probe_env` would build it on a CUDA machine with these kernels
    installed, plus the simulators (for call counts). `cudnn`: the LSE layout of the emulated
    aten cuDNN ops ("H,T" / "T,H,1"; None: no cuDNN), `cudnn_version` the runtime's;
    `frontend`: nvidia-cudnn-frontend installed."""
    from hf_longctx.ops.backends import cudnn as cudnn_adapter
    from hf_longctx.ops.backends import cudnn_frontend as fe_adapter
    from tests.helpers.emulated_cudnn import CudnnOps
    from tests.helpers.emulated_cudnn_frontend import frontend_ops

    sims = {}
    fa, fa_reason = None, "flash-attn is not installed"
    if flash is not None:
        version, iface, ops, sims["flash_attn"] = flash_attn_release(flash, allow_float64=allow_float64)
        api, fa_reason = fa_adapter.detect(version, iface, ops)
        fa = None if api is None else fa_adapter.FlashAttnKernel(api)
    tf = None
    if torch_ops:
        emu = TorchFlashOps(allow_float64=allow_float64)
        sims["torch_flash"] = emu.sim
        assert tf_adapter.detect(emu.forward, emu.backward) is None
        tf = tf_adapter.TorchFlashKernel(emu.forward, emu.backward)
    cd, cd_reason = None, "this torch build has no cuDNN"
    if cudnn is not None:
        ops = CudnnOps(lse_layout=cudnn, allow_float64=allow_float64)
        sims["cudnn"] = ops.sim
        cd_reason = cudnn_adapter.detect(ops.forward, ops.backward, cudnn_version)
        cd = None if cd_reason else cudnn_adapter.CudnnKernel(ops.forward, ops.backward)
    fe, fe_reason = None, fe_adapter.detect(None, None)
    if frontend:
        ops, sims["cudnn_frontend"] = frontend_ops(allow_float64=allow_float64)
        fe_reason = fe_adapter.detect("1.32.0", ops)
        fe = None if fe_reason else fe_adapter.CudnnFrontendKernel(ops)
    env = KernelEnv("cuda", capability, fa, fa_reason or "", tf, "" if tf else "no torch flash", torch_impl if tf else None,
                    False, cd, cd_reason or "", fe, fe_reason or "")
    return env, sims
