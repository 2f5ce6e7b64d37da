"""Inverse of `shard_batch` for per-token outputs: back to the global order (evaluation).

Where it sits: after `model(**shard)` in evaluation, when a caller needs the logits or
hidden states of the whole sequence in the order of the user's original batch. It
all-gathers the shards over the SP group and undoes the permutation of
`hf_longctx/layout.py` (zigzag over the ring, contiguous over Ulysses, rank-ordinal for FPDT,
USP Algorithms 1-2 / FPDT Figure 6), then drops the padding `shard_batch` added.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist

from hf_longctx import layout
from hf_longctx.data.sharding import SP_METADATA_KEY


def gather_sequence(local: torch.Tensor, shard: Mapping[str, Any], mesh) -> torch.Tensor:
    """Inverse of `shard_batch` for a per-token output (logits, hidden states; evaluation).

    Not differentiable. A collective over the SP group: every SP rank must call it.

    Args:
        local: [B, S_local, ...] on every SP rank.
        shard: This rank's shard, as `shard_batch` returned it.
        mesh (SPMesh): The mesh the shard was made on.

    Returns:
        [B, S, ...] in the global order of the user's ORIGINAL batch, padding removed.

    Raises:
        ValueError: `local` does not match the shard's shape.
    """
    info = shard[SP_METADATA_KEY]
    b, s_local = local.shape[:2]
    if b != info.rows or s_local * mesh.sp != info.padded_length:
        raise ValueError(
            f"local tensor of shape {tuple(local.shape)} does not match the shard: expected B = {info.rows} and "
            f"S_local = {info.padded_length} / sp({mesh.sp}) = {info.padded_length // mesh.sp}"
        )
    from hf_longctx.distributed.loss import collective_device

    device = local.device
    local = local.detach().contiguous()
    if mesh.sp_group is None or mesh.sp == 1:
        pieces = [local]
    else:
        local = local.to(collective_device(mesh.sp_group, local))  # NCCL gathers device tensors only
        pieces = [torch.empty_like(local) for _ in range(mesh.sp)]
        dist.all_gather(pieces, local, group=mesh.sp_group)  # SP-group rank j = ring_rank·U + ulysses_rank
    full = local.new_empty((b, info.padded_length, *local.shape[2:]))  # [B, S_pad, ...]
    for j, piece in enumerate(pieces):
        idx = layout.local_indices(
            info.cu_seqlens,
            ring=mesh.ring,
            ulysses=mesh.ulysses,
            ring_rank=j // mesh.ulysses,
            ulysses_rank=j % mesh.ulysses,
            fpdt_chunks=mesh.fpdt_chunks,
        )
        full[:, idx] = piece
    return full[:, info.source_positions()].to(device)  # [B, S, ...] where the caller's tensor was
