"""The flexible step collator: one step's global list of documents -> THIS rank's shards,
one per micro-batch slot, each laid out for the SP group of that slot.

Where it sits: the `LongContextCollator` of a `GroupBank` (FlexSP §4, Hydraulis §4-5). It
cuts documents longer than the largest group holds (`overlong`, the rule of
`pieces.make_pieces`), plans with `plan_flexible` (no collective), and hands the plan to
`flex/step.flex_microbatches` (plan check, ONE fingerprint all-reduce, `shard_batch` per
slot on `bank.mesh(size)`). It has the attributes the trainer's step DataLoader reads from
a `LongContextCollator` plus `last_lengths`, so `training/sft/data.py` wraps either one.
Guarantee (invariant 6): every shard carries the step's global valid-target count."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from hf_longctx.data.collator import check_feature_options, read_documents, require_targets
from hf_longctx.data.token_ids import Vocabulary
from hf_longctx.data.cost import CostModel, GroupCost
from hf_longctx.flex.packing import plan_flexible
from hf_longctx.flex.plan import FlexPlan
from hf_longctx.flex.unequal import plan_unequal
from hf_longctx.data.pieces import OVERLONG, make_pieces
from hf_longctx.flex.step import flex_microbatches, valid_labels
from hf_longctx.flex.bank import GroupBank


def layout_text(layouts: Sequence[Sequence[int]]) -> str:
    """Slot layouts for logs, one bracket per slot: [(4,), (2, 1, 1)] -> "[4] [2+1+1]"."""
    return " ".join("[" + "+".join(str(s) for s in slot) + "]" for slot in layouts)


class FlexCollator:
    """`collator(features)` -> this rank's shards of one step, one per slot (same count on
    every rank). A collective (the plan fingerprint check): every rank calls it with the
    same global list, in the same order.

    `bank`: `init_group_bank(...)`. `max_tokens_per_rank`: padded tokens one rank holds in
    one micro-batch. `cost`: a `GroupCost` with a model for every bank size, or a
    `CostModel` of the whole work, split as `GroupCost.analytic(cost, bank.sizes)` (no
    communication term; fit one with `GroupCost.fit` to include it). `num_slots`: slots to
    aim for (default: the fewest the tokens need). `unequal_calls`: plan with `plan_unequal`
    (ranks get different numbers of micro-batches; the step must run unsharded, see
    `flex/unsharded_step.py`). Features: mappings with `input_ids` and
    optional unshifted targets under `label_key` (-100 = no target) and a 0/1 loss mask
    under `loss_mask_key`, read and checked as `LongContextCollator` does (with `vocab`: every
    id and label against the model's vocabulary, before the fingerprint collective).
    """

    def __init__(
        self, bank: GroupBank, max_tokens_per_rank: int, cost: GroupCost | CostModel, *, overlong: str = "error",
        pad_token_id: int = 0, num_slots: int | None = None, unequal_calls: bool = False,
        label_key: str = "labels", loss_mask_key: str | None = None, vocab: Vocabulary | None = None,
    ) -> None:
        if not isinstance(bank, GroupBank):
            raise TypeError(f"bank must be a GroupBank from init_group_bank, got {type(bank).__name__}")
        if isinstance(max_tokens_per_rank, bool) or not isinstance(max_tokens_per_rank, int) or max_tokens_per_rank < 1:
            raise ValueError(f"max_tokens_per_rank must be a positive int, got {max_tokens_per_rank!r}")
        check_feature_options(pad_token_id, label_key, loss_mask_key, vocab)  # LongContextCollator's checks
        if overlong not in OVERLONG:
            raise ValueError(f"overlong must be one of {OVERLONG}, got {overlong!r}")
        if isinstance(cost, CostModel):
            cost = GroupCost.analytic(cost, bank.sizes)
        if not isinstance(cost, GroupCost):
            raise ValueError(f"cost must be a GroupCost (or a CostModel to split over the sizes), got {type(cost).__name__}")
        missing = [s for s in bank.sizes if s not in cost.sizes]
        if missing:
            raise ValueError(f"cost has no model for the bank's group sizes {missing} (it has {list(cost.sizes)})")
        largest = bank.shape(bank.max_size)
        if largest.capacity(max_tokens_per_rank) < largest.doc_multiple:
            raise ValueError(
                f"max_tokens_per_rank={max_tokens_per_rank}: the largest group ({largest.size} ranks) holds "
                f"{largest.capacity(max_tokens_per_rank)} tokens after padding to {largest.seq_multiple}; no document fits"
            )
        self.bank = bank
        self.max_tokens_per_rank = max_tokens_per_rank
        self.cost = cost
        self.overlong = overlong
        self.pad_token_id = pad_token_id
        self.label_key = label_key
        self.loss_mask_key = loss_mask_key
        self.vocab = vocab
        self.num_slots = num_slots
        if not isinstance(unequal_calls, bool):
            raise ValueError(f"unequal_calls must be a bool, got {unequal_calls!r}")
        self.unequal_calls = unequal_calls
        # The longest piece any group holds: the largest group's capacity (a multiple of
        # its seq_multiple, hence of its doc_multiple). `check_lengths` compares against it.
        self.max_tokens = largest.capacity(max_tokens_per_rank) // largest.doc_multiple * largest.doc_multiple
        self.last_plan: FlexPlan | None = None
        self.last_num_items: int | None = None
        self.last_lengths: list[int] | None = None

    def plan(self, lengths: Sequence[int]) -> FlexPlan:
        """The step's plan for these (piece) lengths, the same on every rank."""
        if self.unequal_calls:
            return plan_unequal(
                lengths, shapes=self.bank.shapes, world_size=self.bank.world_size,
                max_tokens_per_rank=self.max_tokens_per_rank, cost=self.cost,
            )
        return plan_flexible(
            lengths, shapes=self.bank.shapes, world_size=self.bank.world_size, max_tokens_per_rank=self.max_tokens_per_rank,
            cost=self.cost, num_slots=self.num_slots,
        )

    @property
    def stats(self) -> dict[str, Any] | None:
        """The last plan's modelled balance (synced/ideal, per-rank busy max/mean, layouts)."""
        if self.last_plan is None:
            return None
        return {**self.last_plan.stats(self.cost), "num_items_in_batch": self.last_num_items}

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        # [(ids [L], labels [L])]: LongContextCollator's feature checks, labels and loss mask
        docs = read_documents(features, label_key=self.label_key, loss_mask_key=self.loss_mask_key, vocab=self.vocab)
        lengths = np.array([len(ids) for ids, _ in docs], dtype=np.int64)
        cap = f"the largest group: {self.bank.max_size} ranks × max_tokens_per_rank {self.max_tokens_per_rank}"
        pieces = make_pieces(lengths, self.max_tokens, self.overlong, cap)  # a split piece is its own document
        documents = [
            {"input_ids": docs[p.doc][0][p.start : p.end], "labels": docs[p.doc][1][p.start : p.end]} for p in pieces
        ]
        num_items = valid_labels(documents)  # targets of the whole step after the per-piece shift
        require_targets(num_items, lengths.tolist())
        plan = self.plan([p.length for p in pieces])
        out = list(flex_microbatches(plan, self.bank, documents, num_items_in_batch=num_items,
                                     pad_token_id=self.pad_token_id))
        self.last_plan, self.last_num_items, self.last_lengths = plan, num_items, [p.length for p in pieces]
        return out
