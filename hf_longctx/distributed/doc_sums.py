"""Per-document sums of per-token quantities over a sharded packed batch.

Where it sits: after `model(**shard)` on a batch from `data/sharding.shard_batch`, before a
SEQUENCE-level objective (DPO's completion log-ratio, GRPO's per-sequence mean, a
per-document KL), whose documents are spread over the SP ranks. `doc_sums` maps every local
token to its document through the global boundaries and this rank's permutation (built on the
host and uploaded once per micro-batch), sums in fp32 and all-reduces over the SP group.
Guarantees: the result is identical on every SP rank and equals the unsharded sums; the
backward all-reduces the incoming gradient (the adjoint of a sum over ranks), so an
objective `f(sums)` that every SP rank computes enters each rank's loss as `f(sums) / sp`
(or on one rank only), and both give the single-process gradient (loss.py's convention)."""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist

from hf_longctx.data.sharding import IGNORE_INDEX, SP_METADATA_KEY
from hf_longctx.devices import upload


class _SumOverGroup(torch.autograd.Function):
    """y = sum over the group of x (every rank gets y); dx = sum over the group of dy."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)  # [B, D] summed over the SP group
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        dx = dy.contiguous().clone()
        dist.all_reduce(dx, op=dist.ReduceOp.SUM, group=ctx.group)  # [B, D]: every rank's objective
        return dx, None


def document_count(shard: Mapping[str, Any]) -> int:
    """D: documents of the user's row (packed, B = 1) or 1 (one document per row, B > 1)."""
    info = shard[SP_METADATA_KEY]
    return len(info.source_cu_seqlens) - 1


def local_document_ids(shard: Mapping[str, Any], mesh) -> torch.Tensor:
    """int64 [S_local]: the user's document index of every local position; D for padding
    (the trailing padding document added by `shard_batch`)."""
    info = shard[SP_METADATA_KEY]
    d = document_count(shard)
    cu = torch.tensor(info.cu_seqlens, dtype=torch.long)  # [docs_pad + 1] padded boundaries
    idx = mesh.local_indices(info.cu_seqlens)  # [S_local] global padded positions of this rank
    doc = torch.searchsorted(cu, idx, right=True) - 1  # [S_local] padded-document index
    return doc.clamp(max=d)


def device_document_ids(shard: Mapping[str, Any], mesh, device: torch.device) -> torch.Tensor:
    """`local_document_ids` on `device`, built and uploaded once per micro-batch (pinned,
    non-blocking: `devices.upload`) and kept in the shard metadata's `device_cache`: the
    objective's later calls on the same shard read the device copy (no host work, no copy)."""
    info = shard[SP_METADATA_KEY]
    key = ("document_ids", mesh.ring, mesh.ulysses, mesh.fpdt_chunks, mesh.ring_rank, mesh.ulysses_rank, device)
    doc = info.device_cache.get(key)
    if doc is None:
        doc = info.device_cache[key] = upload(local_document_ids(shard, mesh), device)  # [S_local]
    return doc


def target_mask(shard: Mapping[str, Any]) -> torch.Tensor:
    """bool [B, S_local]: positions whose (pre-shifted) target is valid."""
    return shard["shift_labels"] != IGNORE_INDEX


def doc_sums(values: torch.Tensor, shard: Mapping[str, Any], mesh, mask: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [B, D]: per-document sums of `values` over the whole sequence, on every SP rank.

    A collective over `mesh.sp_group`: every SP rank must call it, with the same shard
    metadata.

    Args:
        values: [B, S_local]: a per-token quantity aligned with the shard (e.g. the log-prob
            of `shift_labels`, 1.0 for token counts, a per-token KL).
        shard: This rank's shard, as `shard_batch` returned it.
        mesh (SPMesh): The mesh the shard was made on.
        mask: bool [B, S_local]: positions where it is False contribute 0 (default:
            `target_mask(shard)` when the shard has labels), so garbage at padding or prompt
            positions (even inf/nan) never reaches the sums.

    Returns:
        fp32 [B, D], the sums in the order of the user's documents (packed row: D documents
            of the row; B > 1: one document per row, D = 1).

    Raises:
        ValueError: `values` or `mask` does not match the shard's shape.
    """
    info = shard[SP_METADATA_KEY]
    b, s_local = values.shape[:2] if values.dim() >= 2 else (None, None)
    if values.dim() != 2 or b != info.rows or s_local * mesh.sp != info.padded_length:
        raise ValueError(
            f"values of shape {tuple(values.shape)} do not match the shard: expected [B={info.rows}, "
            f"S_local={info.padded_length // max(mesh.sp, 1)}] -- pass one value per local token of `shard`"
        )
    if mask is None and "shift_labels" in shard:
        mask = target_mask(shard)
    if mask is not None and tuple(mask.shape) != tuple(values.shape):
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not match values {tuple(values.shape)}")
    d = document_count(shard)
    doc = device_document_ids(shard, mesh, values.device)  # [S_local]
    v = values.float()
    if mask is not None:
        v = torch.where(mask.to(values.device), v, torch.zeros((), dtype=v.dtype, device=v.device))  # [B, S_local]
    local = v.new_zeros(b, d + 1).index_add(1, doc, v)[:, :d]  # [B, D]: this rank's part, padding bin dropped
    if mesh.sp_group is None or mesh.sp == 1:
        return local
    from hf_longctx.distributed.loss import collective_device

    device = local.device
    out = _SumOverGroup.apply(local.to(collective_device(mesh.sp_group, local)), mesh.sp_group)
    return out.to(device)  # [B, D] identical on every SP rank
