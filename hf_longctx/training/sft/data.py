"""The trainers' data: one DataLoader item = one optimizer step of THIS rank.

Where it sits: between a `datasets.Dataset` (`input_ids`, optional `labels` and, for padded
rows, `attention_mask`) and the
trainer's `training_step`. Every rank draws the SAME global list of documents per step
(`StepSampler`, invariant 8); the collator plans this DP rank's micro-batches and shards this
SP rank's slice. So the DataLoader is never handed to `accelerator.prepare` (which would
split the list over ranks); its batch sampler yields the step sampler's index lists and its
collate returns ONE `StepBatch` (`base/step_data.py`): the sharded micro-batches, the step's
normaliser, tokens, FLOPs and plan. With a `GroupBank` the collator is `FlexCollator` (one
shard per slot). Nothing is truncated here: overlong documents are the planner's business
(`overlong=`), checked up front by `check_lengths`."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from hf_longctx.data.collator import LongContextCollator
from hf_longctx.data.dataset_columns import check_integer_columns
from hf_longctx.data.padding import MASK_KEY, masked_lengths
from hf_longctx.data.sampler import StepSampler
from hf_longctx.data.sharding import IGNORE_INDEX
from hf_longctx.data.token_ids import Vocabulary, check_token_ids
from hf_longctx.errors import NotSupported
from hf_longctx.flex.collator import FlexCollator, layout_text
from hf_longctx.training.base.step_data import FeatureRows, StepBatch, StepStream


def check_dataset(dataset: Any, name: str = "train_dataset") -> list[str]:
    """The columns the collator reads (`input_ids`, and `labels` and `attention_mask` if
    present); raises for anything that is not a `datasets.Dataset` with `input_ids`, for ids or
    labels that are not integers, and for a per-token column whose rows differ in length from
    `input_ids`."""
    from datasets import Dataset

    if not isinstance(dataset, Dataset):
        raise ValueError(
            f"{name} must be a datasets.Dataset with an 'input_ids' column (the step sampler needs every document's "
            f"length up front), got {type(dataset).__name__}"
        )
    if len(dataset) == 0:
        raise ValueError(
            f"{name} is empty (0 rows, columns: {dataset.column_names}); check the data files / split / filter that "
            "produced it"
        )
    if "input_ids" not in dataset.column_names:
        raise ValueError(
            f"{name} has no 'input_ids' column (columns: {dataset.column_names}); tokenize it first, e.g. "
            "hf_longctx.tokenize_dataset(raw, tokenizer)"
        )
    check_integer_columns(dataset, name)
    per_token = [c for c in ("labels", MASK_KEY) if c in dataset.column_names]
    for column in per_token:
        import pyarrow.compute as pc

        table = dataset.with_format("arrow")
        ids, values = (pc.list_value_length(table[c]) for c in ("input_ids", column))
        differ = pc.indices_nonzero(pc.not_equal(ids, values)).to_pylist()
        if differ:
            i = differ[0]
            what = ("HF's unshifted targets, -100 = no loss" if column == "labels" else "1 = a real token, 0 = padding")
            raise ValueError(
                f"{name} document {i}: '{column}' has {values[i].as_py()} entries but input_ids has {ids[i].as_py()} "
                f"({len(differ)} such row(s)); '{column}' needs one entry per input token ({what}), e.g. made in the "
                f"same dataset.map() that makes input_ids -- or drop the column"
                + (" (the input ids are then the targets)" if column == "labels" else "")
            )
    return ["input_ids", *per_token]


def document_lengths(dataset: Any, name: str = "train_dataset") -> list[int]:
    """Token count of every document: a padded dataset's real tokens (its `attention_mask`,
    checked row by row: `data/padding.py`), else the `length` column of `tokenize_dataset`,
    else the lengths of the `input_ids` lists, read by Arrow (no Python list per row; shuffles
    and selections of the dataset are respected)."""
    if MASK_KEY in dataset.column_names:
        return masked_lengths(dataset, name)
    if "length" in dataset.column_names:
        return [int(n) for n in dataset["length"]]
    import pyarrow.compute as pc

    return pc.list_value_length(dataset.with_format("arrow")["input_ids"]).to_pylist()


def check_dataset_token_ids(dataset: Any, vocab: Vocabulary | None, name: str = "train_dataset") -> None:
    """Every id of the `input_ids` (and `labels`) column against the model's vocabulary, at
    construction: one vectorised Arrow pass over the columns (no Python list per row); the first
    offending row is then named as the per-step check (`token_ids.py`) would name it."""
    if vocab is None:
        return
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")
    for column, limit, ignore in (("input_ids", vocab.embedding_rows, False), ("labels", vocab.logits, True)):
        if column not in dataset.column_names:
            continue
        offset = 0
        for chunk in table[column].chunks:
            flat = pc.list_flatten(chunk)  # [tokens of the chunk's rows]
            bad = pc.or_(pc.less(flat, 0), pc.greater_equal(flat, limit))
            if ignore:
                bad = pc.and_(bad, pc.not_equal(flat, IGNORE_INDEX))
            if pc.any(bad).as_py():
                row = offset + pc.filter(pc.list_parent_indices(chunk), bad)[0].as_py()
                example = dataset[row]
                labels = example.get("labels")
                check_token_ids(torch.as_tensor(example["input_ids"], dtype=torch.long),
                                None if labels is None else torch.as_tensor(labels, dtype=torch.long),
                                vocab, f"{name} document {row}")
            offset += len(chunk)


def check_lengths(lengths: Sequence[int], max_tokens: int, overlong: str, name: str = "train_dataset") -> None:
    """`overlong="error"`: name the first documents longer than the micro-batch cap, before training."""
    if overlong != "error":
        return
    long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens]
    if long:
        shown = ", ".join(f"document {i} has {n} tokens" for i, n in long[:5])
        raise ValueError(
            f"{name}: {len(long)} document(s) exceed max_tokens={max_tokens} ({shown}); nothing is truncated silently: "
            "raise max_tokens, or pass overlong='split' (train the pieces as separate documents) or 'truncate'"
        )


def check_step_budget(
    lengths: Sequence[int], tokens_per_step: int, max_tokens: int, overlong: str, *, name: str = "train_dataset",
    warn: bool = True,
) -> None:
    """`tokens_per_step` against the data. A document longer than the budget forms an over-budget
    step of its own: refused with overlong="error" (every document then fits one micro-batch, so
    the budget is simply too small), said (a warning naming the documents) when the user chose
    to split or truncate long documents. A dataset smaller than one step trains the whole
    dataset every step: exact, but said. `warn`: this process speaks (the main one)."""
    import warnings

    longest = max(range(len(lengths)), key=lambda i: lengths[i], default=None)
    if longest is not None and lengths[longest] > tokens_per_step:
        over = sum(1 for n in lengths if n > tokens_per_step)
        what = (
            f"tokens_per_step={tokens_per_step} is smaller than {over} document(s) of {name} (the longest, document "
            f"{longest}, has {lengths[longest]} tokens): each forms a step of its own, larger than the budget"
        )
        fix = (
            f"raise tokens_per_step to at least {lengths[longest]} (usually several times max_tokens={max_tokens} x "
            "the data-parallel degree), or filter the long documents first"
        )
        if overlong == "error":
            raise NotSupported(what, fix)
        if warn:
            warnings.warn(f"{what} (overlong={overlong!r} then cuts it into micro-batches); to keep steps even, {fix}",
                          stacklevel=3)
    total = int(sum(lengths))
    if warn and 0 < total < tokens_per_step:
        warnings.warn(
            f"{name} holds {total} tokens in {len(lengths)} document(s), fewer than tokens_per_step={tokens_per_step}: "
            "every optimizer step trains the whole dataset (an epoch is one step)",
            stacklevel=3,
        )


def say_truncation(lengths: Sequence[int], max_tokens: int, overlong: str, *, name: str = "train_dataset",
                   warn: bool = True) -> None:
    """`overlong="truncate"`: one warning (from the main process) with what is cut -- documents,
    tokens, share -- since the cut tails are never trained."""
    if overlong != "truncate" or not warn:
        return
    over = [i for i, n in enumerate(lengths) if n > max_tokens]
    if not over:
        return
    import warnings

    longest = max(over, key=lambda i: lengths[i])
    cut, total = sum(lengths[i] - max_tokens for i in over), int(sum(lengths))
    warnings.warn(
        f"overlong='truncate': {len(over)} of {len(lengths)} document(s) of {name} exceed max_tokens={max_tokens} (the "
        f"longest, document {longest}, has {lengths[longest]} tokens); their tails, {cut} of {total} tokens "
        f"({100 * cut / total:.1f} %), are never trained. Pass overlong='split' to train them as separate pieces, or "
        "raise max_tokens",
        stacklevel=3,
    )


class StepCollate:
    """collate_fn: one step's features -> one `StepBatch` (see the module docstring)."""

    def __init__(self, collator: LongContextCollator | FlexCollator, flops_model: Any = None) -> None:
        self.collator = collator
        self.flops_model = flops_model

    def __call__(self, features: list[dict[str, Any]]) -> StepBatch:
        micro_batches = self.collator(features)
        flex = isinstance(self.collator, FlexCollator)
        # What is trained: the plan's pieces (a split document attends within its piece).
        lengths = self.collator.last_lengths if flex else [p.end - p.start for p in self.collator.last_plan.pieces]
        flops = float(self.flops_model(lengths).sum()) if self.flops_model is not None else 0.0
        flops += getattr(self.collator, "last_encoder_flops", 0.0)  # a vision-language model's image encoding
        stats = (self.collator.stats or {}) if self.collator.cost is not None else {}
        return StepBatch(
            micro_batches=micro_batches,
            num_items_in_batch=int(self.collator.last_num_items),
            tokens=int(sum(lengths)),
            flops=flops,
            balance=stats.get("synced_over_ideal"),
            layouts=layout_text(stats["layouts"]) if flex else None,
            busy=stats.get("busy_max_over_mean") if flex else None,
            equal_calls=not (flex and self.collator.unequal_calls),
            plan=self.collator.last_plan,  # the whole step's plan (trainer.last_plan)
            lengths=tuple(int(n) for n in lengths),
            plan_stats=dict(stats),  # the cost model's view of the plan (empty without one)
        )


def step_dataloader(
    dataset: Any,
    collator: LongContextCollator | FlexCollator,
    *,
    tokens_per_step: int,
    seed: int,
    shuffle: bool,
    endless: bool,
    flops_model: Any = None,
    lengths: Sequence[int] | None = None,
    name: str = "train_dataset",
    pin_memory: bool = False,
) -> tuple[torch.utils.data.DataLoader, StepSampler]:
    """(DataLoader of step batches, its StepSampler, whose state a checkpoint saves). `lengths`:
    the documents' token counts when already known; `pin_memory`: pin the step's tensors
    (the Trainer's dataloader_pin_memory, on a CUDA machine).

    num_workers is 0 on purpose: the sampler's position must be exactly the steps consumed
    (a worker's prefetch would advance it), and planning a step costs milliseconds.
    """
    columns = check_dataset(dataset, name)
    columns += [c for c in getattr(collator, "columns", ()) if c in dataset.column_names and c not in columns]  # images
    lengths = document_lengths(dataset, name) if lengths is None else lengths
    check_lengths(lengths, collator.max_tokens, collator.overlong, name)
    sampler = StepSampler(lengths, tokens_per_step=tokens_per_step, seed=seed, shuffle=shuffle)
    loader = torch.utils.data.DataLoader(
        FeatureRows(dataset, columns, name),
        batch_sampler=StepStream(sampler, endless=endless),
        collate_fn=StepCollate(collator, flops_model),
        num_workers=0,
        pin_memory=pin_memory,
    )
    return loader, sampler
