"""Who encodes which image, and where its embeddings go: the vision plan of one SP rank.

Where it sits: `shard_multimodal` calls `deal` and `exchange_plan` after the token layout
is fixed and before any collective; the vision hook (`integrations/vision/forward.py`)
encodes this rank's units and runs ONE all-to-all of embedding rows
(`distributed/vision_exchange.py`) with the counts and orders computed here.
`deal`: encode units go to the SP ranks longest-processing-time-first on a·p² + b·p, so
every rank's work is at most the mean plus one unit (Graham's bound); ties break by index,
so every rank computes the same deal. `exchange_plan`: the send order, counts both ways,
and the permutation into this rank's local placeholder order (the model's `masked_scatter`)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import torch

from hf_longctx import layout


def deal(costs: Sequence[float], ranks: int) -> list[int]:
    """Owner rank of every unit: longest first onto the least-loaded rank (ties: lower index)."""
    order = sorted(range(len(costs)), key=lambda i: (-float(costs[i]), i))
    heap = [(0.0, r) for r in range(ranks)]  # (load, rank)
    owner = [0] * len(costs)
    for i in order:
        load, r = heapq.heappop(heap)
        owner[i] = r
        heapq.heappush(heap, (load + float(costs[i]), r))
    return owner


def rank_indices(cu: Sequence[int], ring: int, ulysses: int, fpdt_chunks: int) -> list[torch.Tensor]:
    """[S_local] global positions held by every SP rank r = ring_rank·U + ulysses_rank."""
    return [
        layout.local_indices(cu, ring=ring, ulysses=ulysses, ring_rank=r // ulysses, ulysses_rank=r % ulysses,
                             fpdt_chunks=fpdt_chunks)
        for r in range(ring * ulysses)
    ]


@dataclass(frozen=True)
class ExchangePlan:
    """One SP rank's side of the embedding exchange.

    send_index: [n_send] rows of this rank's encoder output, in send order (by destination
        rank, then the destination's local position); send_counts / recv_counts: [P] rows to /
        from every rank; recv_order: [n_local] the received row each local vision token takes,
        in local order; local_modality: [n_local] its modality index."""

    send_index: torch.Tensor
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    recv_order: torch.Tensor
    local_modality: torch.Tensor

    @property
    def rows_sent(self) -> int:
        return int(self.send_index.numel())

    @property
    def rows_received(self) -> int:
        return int(self.recv_order.numel())


def exchange_plan(
    unit_positions: Sequence[torch.Tensor], unit_modality: Sequence[int], owner: Sequence[int],
    indices: Sequence[torch.Tensor], me: int, padded_length: int,
) -> ExchangePlan:
    """The plan of SP rank `me`.

    unit_positions[u]: [n_u] padded global positions of unit u's tokens in feature-row order;
    owner[u]: the rank encoding it; indices[r]: [S_local] positions rank r holds (the layout);
    this rank's encoder output is its units' rows concatenated in unit order."""
    p = len(indices)
    rank_of = torch.full((padded_length,), -1, dtype=torch.long)  # [S_pad] which rank holds each position
    slot_of = torch.full((padded_length,), -1, dtype=torch.long)  # [S_pad] its local index there
    for r, idx in enumerate(indices):
        rank_of[idx] = r
        slot_of[idx] = torch.arange(len(idx))
    pos = torch.cat(list(unit_positions)) if unit_positions else torch.empty(0, dtype=torch.long)  # [N] all rows
    src = torch.cat([torch.full((len(x),), owner[u], dtype=torch.long) for u, x in enumerate(unit_positions)]) if unit_positions else pos
    mod = torch.cat([torch.full((len(x),), unit_modality[u], dtype=torch.long) for u, x in enumerate(unit_positions)]) if unit_positions else pos
    dest, slot = rank_of[pos], slot_of[pos]  # [N] each
    if bool((dest < 0).any()):
        raise ValueError("a vision token's position is held by no rank (the layout does not cover the padded row)")
    mine = (src == me).nonzero().flatten()  # [n_own]: rows this rank encodes, in its output order
    key = dest[mine] * padded_length + slot[mine]
    send_index = torch.argsort(key, stable=True)  # [n_own] output row -> send position
    send_counts = tuple(int((dest[mine] == r).sum()) for r in range(p))
    here = (dest == me).nonzero().flatten()  # [n_local] rows that land on this rank
    recv_counts = tuple(int((src[here] == r).sum()) for r in range(p))
    # The buffer arrives grouped by source rank, each group in this rank's local order.
    arrival = here[torch.argsort(src[here] * padded_length + slot[here], stable=True)]  # [n_local]
    recv_order = torch.argsort(slot[arrival], stable=True)  # local order -> row of the buffer
    local_modality = mod[arrival][recv_order]
    return ExchangePlan(send_index, send_counts, recv_counts, recv_order, local_modality)
