"""Differentiable uneven all-to-all for the linear mixers: head scatter/gather and halos.

Where it sits: the collectives of `ops/mixers/{conv,gdn}.py`. Unlike attention's Ulysses
all-to-all (`distributed/comm.py`, even heads over the Ulysses group), a mixer is exchanged
over the WHOLE SP group (a recurrence needs every token of a document) with head counts
that need not divide it, and halos move a few rows per rank: all are one primitive,
`all_to_all_single` with split sizes on a flat buffer.
Guarantees: the backward is the swapped all-to-all of the gradients, so replicated sends
(q/k of one key head, a halo row for two neighbours) have their gradients summed; with
group None every function is a local copy."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from hf_longctx.ops.mixers.layout import SequenceLayout


def exchange_pieces(pieces: Sequence[torch.Tensor], recv_shapes: Sequence[tuple], group) -> list[torch.Tensor]:
    """pieces[q] goes to SP rank q; returns [piece received from rank q of shape recv_shapes[q]]."""
    ref = pieces[0]
    if group is None:
        return [pieces[0].clone()]
    send = torch.cat([p.reshape(-1) for p in pieces]).contiguous()  # [Σ numel] flat, by destination
    in_splits = [p.numel() for p in pieces]
    out_splits = [int(torch.Size(s).numel()) for s in recv_shapes]
    recv = torch.empty(sum(out_splits), dtype=ref.dtype, device=ref.device)  # [Σ numel] flat, by source
    dist.all_to_all_single(recv, send, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
    return [r.view(s) for r, s in zip(recv.split(out_splits), recv_shapes)]


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, recv_shapes, *pieces):
        ctx.group = group
        ctx.send_shapes = [tuple(p.shape) for p in pieces]
        return tuple(exchange_pieces(pieces, recv_shapes, group))

    @staticmethod
    def backward(ctx, *grads):
        grads = [g.contiguous() for g in grads]
        return (None, None, *exchange_pieces(grads, ctx.send_shapes, ctx.group))


def all_to_all_v(pieces: Sequence[torch.Tensor], recv_shapes: Sequence[tuple], group) -> list[torch.Tensor]:
    """Differentiable: pieces[q] → rank q; returns the pieces received, one per source rank."""
    return list(_AllToAllV.apply(group, [tuple(s) for s in recv_shapes], *pieces))


def head_ranges(heads: int, per_group: int, sp: int) -> tuple[tuple[int, int, int, int], ...]:
    """(h_lo, h_hi, g_lo, g_hi) per SP rank: `heads` split as evenly as the group allows,
    with the groups of `per_group` consecutive heads that rank's heads read (a group
    straddling two ranks is sent to both: Mamba-2's B/C groups, Gated DeltaNet's key heads)."""
    out = []
    for p in range(sp):
        h_lo, h_hi = p * heads // sp, (p + 1) * heads // sp
        out.append((h_lo, h_hi, h_lo // per_group, (h_hi - 1) // per_group + 1))
    return tuple(out)


def scatter_channels(x: torch.Tensor, channels: Sequence[torch.Tensor], lay: SequenceLayout, rank: int, group) -> torch.Tensor:
    """Sequence-sharded → channel-sharded, whole sequence in GLOBAL order.

    x [B, S_local, C] (this rank's shard, all channels); channels[q]: int64 channel indices
    rank q receives (may overlap between ranks: replication), on x's device. Returns
    [B, S, C_rank] with C_rank = len(channels[rank]), rows in global token order."""
    b, s_local, _ = x.shape
    pieces = [x.index_select(2, c) for c in channels]  # [B, S_local, C_q] for each q
    recv = all_to_all_v(pieces, [(b, s_local, channels[rank].numel())] * lay.sp, group)  # [B, S_local, C_rank] per source
    full = torch.cat(recv, dim=1)  # [B, S, C_rank]: shards in rank order (positions lay.source_order)
    to_global = lay.on_device("to_global", x.device, lambda: lay.to_global)
    return full.index_select(1, to_global)  # [B, S, C_rank] global order


def gather_channels(y: torch.Tensor, counts: Sequence[int], lay: SequenceLayout, rank: int, group) -> torch.Tensor:
    """Inverse of `scatter_channels` for an output: y [B, S, C_rank] in global order →
    [B, S_local, Σ counts] with the channels of rank 0, then rank 1, ... (counts[q] = C_q)."""
    b, _, c = y.shape
    s_local = lay.local_length
    source_order = lay.on_device("source_order", y.device, lambda: lay.source_order)
    src = y.index_select(1, source_order)  # [B, S, C_rank] in rank-by-rank shard order
    pieces = list(src.split(s_local, dim=1))  # [B, S_local, C_rank] for each destination
    recv = all_to_all_v(pieces, [(b, s_local, n) for n in counts], group)  # [B, S_local, C_q] from each q
    return torch.cat(recv, dim=2)  # [B, S_local, Σ C_q]


def halo_rows(x: torch.Tensor, lay: SequenceLayout, kernel: int, rank: int, group) -> torch.Tensor:
    """x [B, S_local, C] → [B, S_local + N_halo + 1, C]: the shard, the rows of the previous
    K-1 positions of the same document held by other ranks (by source rank), one zero row.
    `lay.halo(kernel).tap_rows[rank]` indexes it."""
    plan = lay.halo(kernel)
    b, _, c = x.shape
    if lay.sp > 1:
        send_rows = lay.on_device(("halo_send", kernel, rank), x.device, lambda: plan.send_rows[rank])
        pieces = [x.index_select(1, rows) for rows in send_rows]  # [B, n_{rank→q}, C]
        recv = all_to_all_v(pieces, [(b, n, c) for n in plan.recv_counts[rank]], group)  # [B, n_{q→rank}, C]
    else:
        recv = []
    zero = x.new_zeros(b, 1, c)
    return torch.cat([x, *recv, zero], dim=1)  # [B, S_local + N_halo + 1, C]
