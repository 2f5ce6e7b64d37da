"""Comparing one module's tensors between the dry run's runs, position by position.

Where it sits: inside `dry_run.probe_model`'s forward hooks. A tensor that keeps the probe's
batch dim and has exactly one dim of the probe's length is sequence-aligned (`seq_view`);
`flatten` / `rebuild` take a module's (args, kwargs) or output apart and put spliced tensors
back; `differs` is the tolerance: GEMM blocking in fp32, two ULPs of the dtype in bf16/fp16.
"""

from __future__ import annotations

from typing import Any

import torch

_REL_TOL = 1e-4  # a per-token model reproduces other positions bit-for-bit up to GEMM blocking
# ... and in bf16 / fp16 up to a rounding of the dtype: a GEMM over a different number of rows
# (runs A/B vs the shorter run C) may pick another cuBLAS kernel whose fp32 accumulation rounds
# to the neighbouring value, one ULP = eps * 2^floor(log2 |x|) <= eps * scale. Two ULPs of room;
# a real leak moves other positions by O(1/tokens) of the scale (~8% on the probe's ~12 tokens).
_ULPS = 2


def seq_view(t: Any, s: int):
    """The sequence dim of `t` (the one dim of size s after the batch dim), or None.

    Only tensors that keep the probe's batch dim (size 1, first) count: a module that
    flattens tokens to [B·S, ...] may also reorder them (an MoE layer sorts its tokens by
    expert before the experts' activation), so a flat tensor's rows are not positions and
    comparing them position by position would blame a per-token module. The enclosing
    module's [B, S, ...] output still exposes any real mixing there."""
    if not isinstance(t, torch.Tensor) or t.is_sparse or t.dim() < 2 or t.shape[0] != 1:
        return None
    dims = [d for d, n in enumerate(t.shape) if n == s and d > 0]
    return dims[0] if len(dims) == 1 else None


def flatten(obj: Any, out: list) -> list:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            flatten(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            flatten(o, out)
    return out


def rebuild(obj: Any, it) -> Any:
    """`obj` with its tensors replaced, in `flatten` order, by the items of `it`."""
    if isinstance(obj, torch.Tensor):
        return next(it)
    if isinstance(obj, (tuple, list)):
        items = [rebuild(o, it) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        new = {k: rebuild(v, it) for k, v in obj.items()}
        try:
            return type(obj)(**new)
        except TypeError:
            return new
    return obj


def differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return True
    if not a.is_floating_point():
        return not torch.equal(a, b)
    scale = a.detach().abs().max().item() if a.numel() else 0.0
    rel = max(_REL_TOL, _ULPS * torch.finfo(a.dtype).eps)  # fp32: 1e-4; bf16: 1.6e-2; fp16: 2.0e-3
    return bool(((a - b).abs() > rel * max(scale, 1e-6)).any()) or bool((a.isnan() != b.isnan()).any())
