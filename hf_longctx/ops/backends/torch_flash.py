"""torch's own CUDA flash kernels with cumulative lengths, behind the packed-kernel contract.

Where it sits: the "torch_flash" backend, driven by `packed.py`; `select.py` picks it on
CUDA where it is the fastest measured, where nothing is measured, or -- as "torch_flash[FA3]"
/ "[FA4]" -- where the user switched torch to FA3/FA4
(`torch.nn.attention.activate_flash_attention_impl`; `_compat.torch_flash_impl` reads
that choice, never makes it). Calls `aten::_flash_attention_forward` / `_backward` (the
ops `torch.nn.attention.varlen.varlen_attn` is built on; torch 2.13 schemas, emulated in
`tests/helpers/emulated_backends.py`) directly, because the backward must start from the
FINAL merged out/lse. Conventions: lse [H, total_q] float32; causal and windows
bottom-right; no softcap; GQA native."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

_NEEDED = {"cum_seq_q", "cum_seq_k", "window_size_left", "window_size_right", "scale"}


def detect(forward_op, backward_op) -> str | None:
    """Why the aten pair cannot serve (None if it can), read from the registered schemas."""
    for op in (forward_op, backward_op):
        schema = getattr(getattr(op, "default", None), "_schema", None)
        if schema is None:
            return f"{op} has no registered schema"
        args = {a.name for a in schema.arguments}
        if not _NEEDED <= args:
            return f"{schema.name} lacks {sorted(_NEEDED - args)}"
    return None


@dataclass(frozen=True)
class TorchFlashKernel:
    flash_forward: Callable  # torch.ops.aten._flash_attention_forward
    flash_backward: Callable  # torch.ops.aten._flash_attention_backward

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale, causal, left, right, softcap):
        if softcap is not None:
            raise ValueError("torch's flash kernels have no softcap; the dispatcher must not send softcap here")
        out, lse, _, _, _ = self.flash_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
            scale=scale, window_size_left=left, window_size_right=right,
        )
        return out, lse.masked_fill(torch.isposinf(lse), float("-inf"))  # [T, H, D], [H, T]

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, scale, causal, left, right, softcap):
        rng_state = torch.zeros((2,), dtype=torch.uint64, device=q.device)  # no dropout: as varlen_attn passes
        unused = torch.empty(0, device=q.device)
        safe_lse = lse.masked_fill(torch.isneginf(lse), float("inf")).contiguous()
        dq, dk, dv = self.flash_backward(
            dout, q, k, v, out, safe_lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng_state, unused,
            scale=scale, window_size_left=left, window_size_right=right,
        )
        return dq, dk, dv
