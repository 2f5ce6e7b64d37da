"""Row chunks of one decoder-layer call: the row ranges, and the call's per-token arguments cut to them.

Where it sits: `integrations/layer_split.py` asks `cut_dim` whether a layer call can be cut
(every per-token keyword argument along a known dim); `integrations/layer_run.py` cuts the
call into row ranges (`row_bounds`) and hands each its rows of those arguments (`kwargs_rows`).
Guarantee: a row range of the arguments is a view (`narrow`), no copy. FPDT §3.3-3.5."""

from __future__ import annotations

import math

import torch


def cut_dim(name: str, tensors: list, s: int) -> int | None:
    """The dim along which the per-token argument `name` is cut (None: not known)."""
    if name.startswith("position_embeddings") and all(t.dim() >= 2 and t.shape[-2] == s for t in tensors):
        return -2  # (cos, sin) [..., S, D]
    if name in ("position_ids", "cache_position") and all(t.shape[-1] == s for t in tensors):
        return -1  # [..., S]
    return None


def kwargs_rows(kwargs: dict, s: int, lo: int, hi: int) -> dict:
    """kwargs with every per-token tensor cut to rows [lo, hi)."""
    out = {}
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            value = value.narrow(cut_dim(name, [value], s) % value.dim(), lo, hi - lo)
        elif isinstance(value, (tuple, list)) and any(isinstance(t, torch.Tensor) for t in value):
            value = type(value)(t.narrow(cut_dim(name, [t], s) % t.dim(), lo, hi - lo) for t in value)
        out[name] = value
    return out


def row_bounds(lo: int, hi: int, pieces: int) -> list[tuple[int, int]]:
    """[lo, hi) cut into at most `pieces` row ranges (none when empty)."""
    if hi <= lo:
        return []
    step = math.ceil((hi - lo) / max(1, pieces))
    return [(a, min(a + step, hi)) for a in range(lo, hi, step)]
