"""Multimodal position ids of a packed row, per document, before sharding.

Where it sits: `shard_multimodal` calls `row_positions` on the whole packed row; the result
is gathered with the same token permutation as `input_ids` (any layout, flexible groups
included). M-RoPE (Qwen2-VL ... Qwen3.5, the families sharing their `get_rope_index`) needs
the whole document, which no shard holds, so the model's own rule (`VisionSpec.positions`)
runs once per document, each from 0.
Guarantee: every shard carries the positions the single-device model computes for its
documents run one by one; a text-only document gets 0..L-1 in all three rows."""

from __future__ import annotations

from typing import Sequence

import torch

from hf_longctx.data.multimodal.items import RowVision
from hf_longctx.data.multimodal.spec import VisionSpec


def row_positions(ids: torch.Tensor, cu: Sequence[int], vision: RowVision, spec: VisionSpec) -> torch.Tensor:
    """int64 [3, S]: the row's M-RoPE positions, each document computed alone from 0."""
    parts = []
    for d, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        grids, extras = {}, {}
        for mi, m in enumerate(spec.modalities):
            mine = [k for k, (doc, _) in enumerate(vision.items[mi]) if doc == d]
            if not mine:
                continue
            grids[m.name] = torch.tensor([vision.items[mi][k][1] for k in mine], dtype=torch.long)  # [n, 3]
            for key, value in vision.extras[mi].items():
                extras[key] = value[mine]
        if not grids:
            parts.append(torch.arange(b - a, dtype=torch.long).expand(3, b - a))  # [3, L]
            continue
        pos = spec.positions(ids[a:b], grids, extras)  # [3, L]
        if tuple(pos.shape) != (3, b - a):
            raise RuntimeError(f"{spec.family}'s position rule returned shape {tuple(pos.shape)} for a document of {b - a} tokens")
        parts.append(pos.long())
    return torch.cat(parts, dim=1)  # [3, S]
