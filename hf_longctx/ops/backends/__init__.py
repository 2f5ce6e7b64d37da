"""Local attention backends: one file per kernel family, one (out, lse) contract.

Where it sits: between `ops/kernels.py` (the public varlen_forward / varlen_backward /
block_* entry points every attention path calls) and the kernels themselves.

- `capabilities.py`: the table (kernel x window, GQA, lse, softcap, dtypes, head dims,
  causal alignment) the dispatcher reads and the README shows.
- `select.py`: probe once (cached in `_compat`), choose per call chain.
- `packed.py`: one varlen call per wave of planned tiles (flash-attn, torch flash);
  `sequences.py`: those waves, planned from the tiles.
- `tiled.py`: one call per tile with boolean masks (aten CPU op, math kernel).
- `flash_attn.py`, `torch_flash.py`, `aten_cpu.py`: adapters to each external API;
  the math kernel lives in `ops/math_kernel.py`.

Every backend has `forward(q, k, v, blocks, *, scale, causal, window, softcap, out_dtype,
widen=True) -> (out [B, H, Sq, D], lse [B, H, Sq])` (`widen=False`: a fused kernel's output
may stay in its own dtype for a caller that merges it in place) and `backward(dout, q, k, v, out, lse, blocks, *,
scale, causal, window, softcap, grad_dtype) -> (dq, dk, dv)`, rows without keys giving
out 0 / lse -inf, the backward taking the FINAL out/lse (FlashAttention-2, Algorithm 2).
"""

from hf_longctx.ops.backends.capabilities import CAPABILITIES, markdown_table, refusal
from hf_longctx.ops.backends.select import ATEN_CPU, MATH, KernelEnv, backend_for, probe_env, select_backend

__all__ = [
    "ATEN_CPU", "CAPABILITIES", "MATH", "KernelEnv", "backend_for", "markdown_table", "probe_env", "refusal",
    "select_backend",
]
