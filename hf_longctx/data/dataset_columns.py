"""A tokenized dataset's token columns, checked at construction in vectorised Arrow passes: ids
and labels stored as integers, and at least one token that carries loss.

Where it sits: the trainers' dataset checks (`training/sft/data.py`), before the step sampler
and any collective; the collators check every step's rows the same way (`data/collator.py`),
so a dataset made of rows they would refuse is refused once, up front, with the fix, instead
of at step 1. A target is counted as the loss counts it (DESIGN invariants 1 and 6: labels
shifted per document, so a document's first real token is never a target; a padded row's pads,
`data/padding.py`, carry none).
"""

from __future__ import annotations

from typing import Any

from hf_longctx.data.padding import MASK_KEY
from hf_longctx.errors import NotSupported

IGNORE_INDEX = -100


def check_integer_columns(dataset: Any, name: str = "train_dataset") -> None:
    """`input_ids` and `labels` (when present) hold integers: a float or bool column (ids written
    through pandas, or a JSON file with a null) would be cast silently or refused at step 1."""
    import pyarrow as pa

    schema = dataset.data.schema
    for column in ("input_ids", "labels"):
        if column not in dataset.column_names:
            continue
        kind = schema.field(column).type
        value = getattr(kind, "value_type", kind)  # list<item: T> -> T
        if not pa.types.is_integer(value):
            raise NotSupported(
                f"{name}: column '{column}' holds {value} values ({dataset.features[column]}), not integers: token ids "
                f"and labels are integer indices" + (" (-100 = no loss)" if column == "labels" else ""),
                f"cast it once the values are whole numbers: {name} = {name}.cast_column('{column}', "
                "datasets.Sequence(datasets.Value('int64'))); or tokenize again with the tokenizer, whose ids are ints",
            )


def count_targets(dataset: Any) -> int:
    """Tokens of `dataset` that carry loss, as the loss counts them: a label other than -100
    (the input id itself without a `labels` column) on a real token that is not its document's
    first (labels shift per document; a padded row's real tokens per its `attention_mask`, whose
    padding `data/padding.masked_lengths` has checked to sit at one end of the row)."""
    import numpy as np
    import pyarrow.compute as pc

    column = "labels" if "labels" in dataset.column_names else "input_ids"
    masked = MASK_KEY in dataset.column_names
    table = dataset.select_columns([column, MASK_KEY] if masked else [column]).with_format("arrow")[:]
    total = 0
    for batch in table.to_batches():  # the columns' rows aligned
        values = batch.column(column)
        flat = np.asarray(pc.list_flatten(values).to_numpy(zero_copy_only=False))  # [tokens of the batch]
        offsets = np.asarray(values.offsets.to_numpy(zero_copy_only=False))  # [rows + 1]
        starts, lengths = offsets[:-1] - offsets[0], np.diff(offsets)  # [rows]
        row = np.repeat(np.arange(len(values)), lengths)  # [tokens]: the row of each token
        position = np.arange(len(flat)) - starts[row]  # [tokens]: position in the row
        first = np.zeros(len(values), dtype=np.int64)  # [rows]: the document's first real token
        real = np.ones(len(flat), dtype=bool)  # [tokens]
        if masked:
            real = np.asarray(pc.list_flatten(batch.column(MASK_KEY)).to_numpy(zero_copy_only=False)) == 1
            ones = np.bincount(row, weights=real, minlength=len(values)).astype(np.int64)  # [rows]
            opens_with_pad = np.zeros(len(values), dtype=bool)
            filled = lengths > 0
            opens_with_pad[filled] = ~real[starts[filled]]
            first = np.where(opens_with_pad, lengths - ones, 0)  # left padding: the real tokens end the row
        total += int(((flat != IGNORE_INDEX) & real & (position > first[row])).sum())
    return total


def require_dataset_targets(dataset: Any, name: str = "train_dataset") -> None:
    """At least one token of `dataset` carries loss (`count_targets`); else refused, with why
    and the fix, before the first step would find a step without a target."""
    if count_targets(dataset) > 0:
        return
    if "labels" in dataset.column_names:
        what = (f"every label of {name}'s {len(dataset)} row(s) is -100 (or on a document's first token or a pad, "
                "which the per-document shift never trains): no token carries loss")
        fix = ("labels are HF's unshifted targets: the token's own id where it is learned, -100 only where it is not "
               "(e.g. the prompt); check the masking that built the column (a completion or assistant mask of all "
               "zeros, a chat template without assistant turns), or drop the 'labels' column to learn every token")
    else:
        what = f"every document of {name}'s {len(dataset)} row(s) has one real token: nothing is left to predict"
        fix = "train on documents of two tokens or more (a document's first token is never a target)"
    raise NotSupported(what, fix)
