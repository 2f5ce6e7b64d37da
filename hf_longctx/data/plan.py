"""The fixed-degree plan of one step: which pieces of which documents each DP rank runs in
each micro-batch.

Where it sits: `packing.plan_microbatches` builds it (the same on every rank);
`data/collator.py` packs each micro-batch of `plan[mesh.dp_rank]`; `cli/load_plot.py` and the
Trainer's `last_plan` report it. `Plan.stats` gives its balance under a cost model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hf_longctx.data.cost import DEFAULT_COST, CostModel


class Piece(NamedTuple):
    """Tokens [start, end) of document `doc`: a whole document unless it was split or
    truncated because it exceeded the micro-batch cap.

    Attributes:
        doc: The document's index in the step's list.
        start: The piece's first token in the document.
        end: One past its last token.
    """

    doc: int
    start: int
    end: int

    @property
    def length(self) -> int:
        """Tokens of this piece (`end - start`)."""
        return self.end - self.start


def ceil_to(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclass(frozen=True)
class Plan:
    """`ranks[r][m]`: piece indices of DP rank r's m-th micro-batch, in packing order.

    Every rank has the same number of micro-batches (FSDP runs the same collectives
    on all ranks). A micro-batch is empty only when the step has fewer pieces than
    dp_size × num_microbatches slots; the collator then feeds one padding document.
    Micro-batch slot m is ordered from the costliest slot to the cheapest.

    Attributes:
        ranks: `ranks[r][m]`: the indices into `pieces` of DP rank r's m-th micro-batch.
        pieces: The step's pieces (documents, or parts of a split or truncated one).
        max_tokens: Tokens one SP group holds in one micro-batch, padding included.
        doc_multiple: Each piece is padded to a multiple of this.
        seq_multiple: Each micro-batch's total is rounded up to a multiple of this.
        strategy: The planner that made the plan (`plan_microbatches`' `strategy`).
    """

    ranks: list[list[list[int]]]
    pieces: list[Piece]
    max_tokens: int
    doc_multiple: int = 1
    seq_multiple: int = 1
    strategy: str = "balanced"

    def __getitem__(self, rank: int) -> list[list[int]]:
        return self.ranks[rank]

    def __len__(self) -> int:
        return len(self.ranks)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks the plan assigns micro-batches to."""
        return len(self.ranks)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per rank (every rank runs the same number)."""
        return len(self.ranks[0]) if self.ranks else 0

    def padded_length(self, piece: int) -> int:
        """Tokens piece `piece` occupies once padded to `doc_multiple`."""
        return ceil_to(self.pieces[piece].length, self.doc_multiple)

    def microbatch_tokens(self, rank: int, microbatch: int) -> int:
        """Tokens of one micro-batch, padding included (documents to `doc_multiple`,
        the total to `seq_multiple`)."""
        total = sum(self.padded_length(p) for p in self.ranks[rank][microbatch])
        return ceil_to(total, self.seq_multiple)

    def stats(self, cost: CostModel | None = None) -> dict[str, float]:
        """Balance figures of this plan under `cost` (default `DEFAULT_COST`).

        A micro-batch costs Σ cost(padded piece length); the padding document that
        rounds the total up to `seq_multiple` is not counted.
        """
        cost = DEFAULT_COST if cost is None else cost
        d, m = self.dp_size, self.num_microbatches
        padded = np.array([self.padded_length(p) for p in range(len(self.pieces))], dtype=np.int64)
        piece_cost = cost(padded) if len(padded) else np.zeros(0)
        mb_cost = np.zeros((d, m))
        mb_tokens = np.zeros((d, m), dtype=np.int64)
        for r in range(d):
            for j, mb in enumerate(self.ranks[r]):
                mb_cost[r, j] = piece_cost[mb].sum() if mb else 0.0
                mb_tokens[r, j] = self.microbatch_tokens(r, j)
        rank_cost = mb_cost.sum(axis=1)
        total = float(rank_cost.sum())
        ideal = total / d
        synced = float(mb_cost.max(axis=0).sum()) if m else 0.0
        mean = float(rank_cost.mean())
        real = int(sum(p.length for p in self.pieces))
        return {
            "dp_size": d,
            "num_microbatches": m,
            "num_pieces": len(self.pieces),
            "rank_cost_max": float(rank_cost.max()),
            "rank_cost_mean": mean,
            "rank_max_over_mean": float(rank_cost.max()) / mean if mean > 0 else 1.0,
            "synced_step": synced,
            "ideal_step": ideal,
            "synced_over_ideal": synced / ideal if ideal > 0 else 1.0,
            "tokens_per_microbatch_max": int(mb_tokens.max()) if m else 0,
            "tokens_per_microbatch_mean": float(mb_tokens.mean()) if m else 0.0,
            "fill": float(mb_tokens.mean()) / self.max_tokens if m else 0.0,
            "padding_tokens": int(mb_tokens.sum()) - real,
        }
