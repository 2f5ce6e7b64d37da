"""Collectives of sequence parallelism, differentiable.

Where it sits: called by `ops/ulysses.py` (and FPDT per chunk) to move q/k/v from the
sequence-sharded layout to the head-sharded one and back (USP paper Algorithm 1, the
Ulysses all-to-all; DeepSpeed-Ulysses §3), and by `ops/ring.py` to pass K/V blocks and
their gradients around the ring with point-to-point sends that overlap the next
transfer with the current block's compute (USP paper Algorithm 2).

With group None (one process, or degree 1) every function is the identity.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_to_all(buf: torch.Tensor, group) -> torch.Tensor:
    """buf [U, ...] contiguous: slice i goes to rank i; returns [U, ...] with slice i from rank i."""
    out = torch.empty_like(buf)
    dist.all_to_all_single(out, buf, group=group)  # [U, ...] → [U(source), ...]
    return out


def _send_buffer(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """parts[i] [U, B, S, w_i, D] (any strides: views of the caller's tensors) → the send
    buffer [U, B, S, Σw_i·D] in one copy: each element is read once where it lies (no
    contiguous copy of a part before the concatenation, no concatenation of a single part,
    which needs no copy at all when its permuted layout already is contiguous)."""
    u, b, s = parts[0].shape[:3]
    if len(parts) == 1:
        return parts[0].reshape(u, b, s, -1).contiguous()
    return torch.cat(parts, dim=3).view(u, b, s, -1)  # [U, B, S, Σw, D] → [U, B, S, Σw·D]


def seq_to_head(tensors: Sequence[torch.Tensor], group) -> list[torch.Tensor]:
    """[B, S_local, Hx, D] each → [B, U·S_local, Hx/U, D] each, in ONE all-to-all.

    Every tensor's head count must be divisible by U (the caller replicates KV heads
    first when H_kv < U). Received pieces are ordered by Ulysses rank, which is the
    order of the contiguous Ulysses pieces in the layout, so the result is the ring
    rank's token stream. Inputs may have any strides (gradients as autograd hands them).
    """
    u = group_size(group)
    if u == 1:
        return list(tensors)
    b, s, _, d = tensors[0].shape
    heads = [t.shape[2] for t in tensors]
    # head slice i of every tensor goes to rank i: [B, S, Hx, D] → [U, B, S, Hx/U, D] views
    parts = [t.unflatten(2, (u, t.shape[2] // u)).permute(2, 0, 1, 3, 4) for t in tensors]
    recv = _all_to_all(_send_buffer(parts), group)  # [U(source), B, S_local, ΣHx/U·D]
    outs = []
    for t, piece in zip(tensors, recv.split([h // u * d for h in heads], dim=-1)):
        piece = piece.reshape(u, b, s, t.shape[2] // u, d)  # [U, B, S_local, Hx/U, D]
        outs.append(piece.permute(1, 0, 2, 3, 4).reshape(b, u * s, t.shape[2] // u, d))  # [B, U·S_local, Hx/U, D]
    return outs


def head_to_seq(tensors: Sequence[torch.Tensor], group) -> list[torch.Tensor]:
    """[B, U·S_local, h, D] each → [B, S_local, U·h, D] each, in ONE all-to-all (inverse of
    seq_to_head). Inputs may have any strides."""
    u = group_size(group)
    if u == 1:
        return list(tensors)
    b, su, _, d = tensors[0].shape
    s = su // u
    heads = [t.shape[2] for t in tensors]
    # sequence piece i goes to rank i: [B, U·S_local, h, D] → [U, B, S_local, h, D] views
    parts = [t.unflatten(1, (u, s)).permute(1, 0, 2, 3, 4) for t in tensors]
    recv = _all_to_all(_send_buffer(parts), group)  # [U(source = head slice), B, S_local, Σh·D]
    outs = []
    for h, piece in zip(heads, recv.split([h * d for h in heads], dim=-1)):
        piece = piece.reshape(u, b, s, h, d)  # [U, B, S_local, h, D]
        outs.append(piece.permute(1, 2, 0, 3, 4).reshape(b, s, u * h, d))  # [B, S_local, U·h, D]
    return outs


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        return tuple(seq_to_head(tensors, group))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *head_to_seq(grads, ctx.group))


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        return tuple(head_to_seq(tensors, group))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *seq_to_head(grads, ctx.group))


def all_to_all_seq_to_head(*tensors: torch.Tensor, group) -> tuple[torch.Tensor, ...]:
    """Differentiable `seq_to_head`; gradients travel back through the inverse all-to-all."""
    if group_size(group) == 1:
        return tensors
    return _SeqToHead.apply(group, *tensors)


def all_to_all_head_to_seq(*tensors: torch.Tensor, group) -> tuple[torch.Tensor, ...]:
    """Differentiable `head_to_seq`."""
    if group_size(group) == 1:
        return tensors
    return _HeadToSeq.apply(group, *tensors)


class RingExchanger:
    """Point-to-point ring shifts: send to the next ring rank, receive from the previous.

    `start(t)` posts the send of `t` and the receive of an equally shaped tensor with
    `batch_isend_irecv` and returns at once, so the caller computes on the current block
    while the next one is in flight; `wait()` returns the received tensor. `next_rank` /
    `prev_rank` are GLOBAL ranks (P2P ops address peers by global rank).
    """

    def __init__(self, group, next_rank: int, prev_rank: int, tag: int = 0):
        self.group = group
        self.tag = tag  # distinct tags keep two exchangers in flight between the same peers apart
        self.next_rank = next_rank
        self.prev_rank = prev_rank
        self._works: list = []
        self._recv: torch.Tensor | None = None

    def start(self, tensor: torch.Tensor) -> None:
        if self._works:
            raise RuntimeError("RingExchanger.start called twice without wait()")
        tensor = tensor.contiguous()
        self._recv = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next_rank, self.group, self.tag),
            dist.P2POp(dist.irecv, self._recv, self.prev_rank, self.group, self.tag),
        ]
        self._works = dist.batch_isend_irecv(ops)
        self._send = tensor  # keep the send buffer alive until the transfer completes

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._works = []
        recv, self._recv, self._send = self._recv, None, None
        return recv
