"""The one exchange of visual embeddings per micro-batch, differentiable both ways.

Where it sits: called by the vision hook (`integrations/vision/forward.py`) after each SP
rank has encoded its share of the images and video slices (`data/multimodal/routing.py`).
Rows travel from the encoding rank to the rank whose shard holds their placeholders in ONE
uneven `all_to_all_single` (DeepStack levels as extra columns); the backward is the same
exchange with the counts swapped, so the tower and projector train exactly as on one device.
Guarantee: a rank with nothing to send or receive still joins (zero rows) and its received
tensor is always used, so every rank runs the backward collective; group None is the identity."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def _exchange(x: torch.Tensor, send: Sequence[int], recv: Sequence[int], group) -> torch.Tensor:
    """x [Σ send, F] (rows grouped by destination) -> [Σ recv, F] (rows grouped by source)."""
    out = x.new_empty((sum(recv), x.shape[1]))  # [Σ recv, F]
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(recv), input_split_sizes=list(send), group=group)
    return out


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None  # [Σ send, F] back to the encoders


def exchange_rows(x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], group) -> torch.Tensor:
    """Differentiable uneven all-to-all of rows: `x` [Σ send_counts, F], its first
    send_counts[0] rows to rank 0 of `group`, the next to rank 1, ...; returns
    [Σ recv_counts, F], recv_counts[r] rows from rank r, in rank order."""
    if x.dim() != 2 or x.shape[0] != sum(send_counts):
        raise ValueError(f"exchange_rows: x must be [Σ send_counts = {sum(send_counts)}, F], got {tuple(x.shape)}")
    if group is None or dist.get_world_size(group) == 1:
        return x
    if len(send_counts) != dist.get_world_size(group) or len(recv_counts) != len(send_counts):
        raise ValueError(f"exchange_rows: {len(send_counts)} send / {len(recv_counts)} receive counts for a group of {dist.get_world_size(group)}")
    return _Exchange.apply(x, tuple(int(c) for c in send_counts), tuple(int(c) for c in recv_counts), group)
