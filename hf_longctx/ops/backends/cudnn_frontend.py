"""cuDNN attention through nvidia-cudnn-frontend's torch ops, behind the packed-kernel contract.

Where it sits: the "cudnn_frontend" backend, driven by `packed.py` exactly like the flash
kernels (bottom-right bands, `sequences.py`); `select.py` offers it on CUDA when
`_compat.cudnn_frontend_ops` finds `torch.ops.cudnn.sdpa_fwd` / `sdpa_bwd` registered and
`detect` accepts their schemas. Contract read from the wheel (nvidia-cudnn-frontend 1.32,
`cudnn/sdpa/fwd/torch_op.py`, emulated in `tests/helpers/emulated_cudnn_frontend.py`):
THD q/k/v [T, H(_kv), D] with `cu_seqlens_q/kv` and max lengths, GQA native; a band is
cuDNN's diagonal band: `window_left` = lb keeps j > i - lb (flash-attn's left + 1,
`cudnn/torch/sdpa_provider.py`), `window_right` = rb keeps j <= i + rb, `is_causal` is rb = 0
and must not come with rb > 0, `causal_bottom_right` anchors an active band at each sequence's
last row and key; the forward's LSE is [T, H, 1] float32 in natural-log units, the backward
takes it PADDED [B, H, max_seqlen_q, 1] (cuDNN rejects ragged LSE in a THD backward); the op
copies a strided or misaligned operand itself. The SDPA ops need no CUTLASS DSL: its metadata
and LSE-padding kernels fall back to torch code when `cutlass` is absent."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_NEEDED_FWD = ("q", "k", "v", "attn_scale", "is_causal", "causal_bottom_right", "window_left", "window_right",
               "cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv", "return_lse")
_NEEDED_BWD = ("grad_out", "q", "k", "v", "o", "lse", "attn_scale", "is_causal", "causal_bottom_right", "window_left",
               "window_right", "cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv", "is_deterministic")


def detect(version: str | None, ops) -> str | None:
    """Why `ops` (`torch.ops.cudnn`, or None when the package is absent) cannot serve, or None."""
    if ops is None:
        return "nvidia-cudnn-frontend is not installed (or its SDPA torch ops do not load)"
    for name, needed in (("sdpa_fwd", _NEEDED_FWD), ("sdpa_bwd", _NEEDED_BWD)):
        schema = getattr(getattr(getattr(ops, name, None), "default", None), "_schema", None)
        if schema is None:
            return f"nvidia-cudnn-frontend {version} registers no torch op cudnn::{name}"
        args = [a.name for a in schema.arguments]
        missing = [a for a in needed if a not in args]
        if missing:
            return f"nvidia-cudnn-frontend {version}: cudnn::{name} lacks {missing} in its schema {schema}"
    return None


def band(causal: bool, left: int, right: int) -> dict:
    """flash-attn's bottom-right (left, right) window (-1 = unbounded; `causal` = right 0) as
    the op's keywords."""
    right = 0 if causal else right
    kw = dict(is_causal=right == 0, window_left=left + 1 if left >= 0 else -1, window_right=right if right > 0 else -1)
    kw["causal_bottom_right"] = kw["is_causal"] or left >= 0 or right > 0  # only with an active band
    return kw


def padded_lse(lse: torch.Tensor, cu_q: torch.Tensor, max_q: int) -> torch.Tensor:
    """[H, T] -> [B, H, max_q, 1]: each token's value at (its sequence, its position), zeros past
    a sequence's end (ignored by the kernel). Device-side: no host read of the lengths."""
    h, t = lse.shape
    cu = cu_q.long()
    token = torch.arange(t, device=lse.device)
    seq = torch.searchsorted(cu[1:], token, right=True)  # [T]
    padded = lse.new_zeros(cu.numel() - 1, h, max_q, 1)
    padded[seq, :, token - cu[seq], 0] = lse.t()  # [T, H] into (sequence, head, position)
    return padded


@dataclass(frozen=True, eq=False)  # identity: one backend object per ops namespace (`select._packed`)
class CudnnFrontendKernel:
    ops: object  # torch.ops.cudnn

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale, causal, left, right, softcap):
        if softcap is not None:
            raise ValueError("cuDNN attention has no softcap; the dispatcher must not send softcap here")
        out, stats = self.ops.sdpa_fwd(q, k, v, scale, **band(causal, left, right), cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k,
                                       max_seqlen_q=max_q, max_seqlen_kv=max_k, return_lse=True)
        return out, stats[:, :, 0].t().contiguous()  # [T, H, D], [H, T]

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, scale, causal, left, right, softcap):
        return self.ops.sdpa_bwd(
            dout, q, k, v, out, padded_lse(lse, cu_q, max_q), scale, **band(causal, left, right), cu_seqlens_q=cu_q,
            cu_seqlens_kv=cu_k, max_seqlen_q=max_q, max_seqlen_kv=max_k,
            is_deterministic=torch.are_deterministic_algorithms_enabled(),
        )
