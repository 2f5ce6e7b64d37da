"""Local attention backends: one file per kernel family, one (out, lse) contract.

Where it sits: between `ops/kernels.py` (the varlen_forward / varlen_backward / block_*
entry points every attention path calls) and the kernels: `capabilities.py` (the table),
`select.py` (the choice), `packed.py` + `sequences.py` (varlen kernels: flash-attn, torch
flash, cuDNN through torch's ops -- `square_causal.py` -- and through cudnn-frontend),
`tiled.py` (one call per tile: aten CPU op, `ops/math_kernel.py`), and one adapter per
external API. Every backend has `forward(q, k, v, blocks, *, scale, causal, window,
softcap, out_dtype, widen=True) -> (out [B, H, Sq, D], lse [B, H, Sq])` and
`backward(dout, q, k, v, out, lse, blocks, *, ...) -> (dq, dk, dv)`: rows without keys give
out 0 / lse -inf, and the backward takes the FINAL out/lse (FlashAttention-2, Algorithm 2)."""

from hf_longctx.ops.backends.capabilities import CAPABILITIES, markdown_table, refusal
from hf_longctx.ops.backends.select import (
    ATEN_CPU, MATH, AttentionChoice, KernelEnv, backend_for, probe_env, select_backend,
)

__all__ = [
    "ATEN_CPU", "CAPABILITIES", "MATH", "AttentionChoice", "KernelEnv", "backend_for", "markdown_table", "probe_env",
    "refusal", "select_backend",
]
