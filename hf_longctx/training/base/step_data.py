"""The parts of a step DataLoader that do not depend on what a step holds: `StepBatch` (the one
item the DataLoader yields per optimizer step), the batch sampler that turns the step
sampler's index lists into an endless stream of steps, and the dataset rows as collator
features (each naming its source row).

Where it sits: under the SFT and DPO step DataLoaders (`sft/data.py`, `dpo/data.py`): every
rank draws the same global list of rows per step (`StepSampler`, DESIGN invariant 8).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from hf_longctx.data.sampler import StepSampler
from hf_longctx.data.token_ids import DOCUMENT_KEY


@dataclass
class StepBatch:
    """One optimizer step of THIS rank, as the step DataLoader yields it.

    `micro_batches`: this rank's micro-batches as the trainer's `_micro_inputs` takes them
    (`shard_batch` dicts; GRPO: the rows of one packed micro-batch; the count varies per step). `num_items_in_batch`: the normaliser of the WHOLE step, every rank alike (valid
    targets; preference pairs for DPO). `tokens` / `flops`: trained tokens and estimated FLOPs
    of the whole step. `plan`, `lengths`, `plan_stats`: the step's plan, its pieces' token
    counts and the cost model's view of it (kept as `trainer.last_plan`). `balance`: the plan's
    synced/ideal cost (None without a cost model); `layouts` / `busy`: a group bank's slot
    layouts and per-rank busy max/mean; `equal_calls`: every rank runs the same number of
    micro-batches (False only for a bank's `unequal_calls` plan).
    """

    micro_batches: list[dict[str, Any]]
    num_items_in_batch: int
    tokens: int
    flops: float
    plan: Any
    lengths: tuple[int, ...]
    plan_stats: dict[str, Any] = field(default_factory=dict)
    balance: float | None = None
    layouts: str | None = None
    busy: float | None = None
    equal_calls: bool = True


class StepStream(torch.utils.data.Sampler):
    """Batch sampler of the step DataLoader: the step sampler's index lists.

    `endless=True` (training) continues into the next epoch instead of ending, so a Trainer
    "epoch" (`len()` = the steps of the sampler's first epoch; epochs differ slightly since
    steps are cut by a token budget) never drops the tail of a sampler epoch; `max_steps` ends
    training. `endless=False` (evaluation) yields one pass.
    """

    def __init__(self, sampler: StepSampler, *, endless: bool) -> None:
        self.sampler = sampler
        self.endless = endless
        self._len = len(sampler.epoch_steps(sampler.epoch))

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[list[int]]:
        if not self.endless:
            yield from self.sampler
            return
        while True:
            empty = True
            for indices in self.sampler:
                empty = False
                yield indices
            if empty:
                raise ValueError("the step sampler yields no step: the dataset is empty")


class FeatureRows(torch.utils.data.Dataset):
    """Dataset rows as the collator's features (only the columns it reads), fetched per step;
    each names its source row under `DOCUMENT_KEY`, so a bad row is named by its index."""

    def __init__(self, dataset: Any, columns: list[str], name: str = "dataset", unit: str = "document") -> None:
        self.dataset = dataset
        self.columns = columns
        self.name = name
        self.unit = unit

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        rows = self.dataset.select_columns(self.columns)[indices]  # {column: [value per document]}
        return [
            {**dict(zip(self.columns, values)), DOCUMENT_KEY: f"{self.name} {self.unit} {i}"}
            for i, values in zip(indices, zip(*(rows[c] for c in self.columns)))
        ]

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.__getitems__([index])[0]
