"""Tokenize a `datasets` corpus into documents with a `length` column.

Where it sits: the first stage of the data flow. Its output feeds the step sampler
(`data/sampler.py`, which needs every document's length up front) and, through the
planner (`data/packing.py`), the collator. One row stays one document: nothing is
concatenated, truncated or dropped here; over-long documents are the planner's business
(`overlong="error" | "truncate" | "split"`).

Which paper section: the per-document lengths that the cost model of Hydraulis and the
FlexSP appendix take as input (T(l) depends on each document's own length, so documents
must not be pre-packed into fixed blocks).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Sequence

if TYPE_CHECKING:  # imported lazily: `import hf_longctx` must not pay for datasets
    from datasets import Dataset, IterableDataset


def tokenize_dataset(
    ds: Dataset | IterableDataset,
    tokenizer: Any,
    *,
    text_column: str = "text",
    add_eos: bool = True,
    add_special_tokens: bool = True,
    keep_columns: Sequence[str] = (),
    batch_size: int = 1000,
    num_proc: int | None = None,
    progress: bool | None = None,
) -> Dataset | IterableDataset:
    """`ds.map(batched=True)` to rows of `input_ids` (list of ints) and `length` (int).

    Args:
        ds: The dataset of texts.
        tokenizer: A `transformers` tokenizer.
        text_column: The column holding the texts.
        add_eos: Append the tokenizer's EOS so the model learns where documents end (each document is its own
            attention segment once packed).
        add_special_tokens: Passed to the tokenizer (e.g. its BOS).
        keep_columns: Columns kept beside `input_ids` and `length`; the others are removed (for an `IterableDataset`
            whose columns are unknown until read, only `text_column` can be removed).
        batch_size: Texts per `map` batch.
        num_proc: Processes for `map` (`Dataset` only).
        progress: Show `datasets`' progress bar; default: only in the job's first process (the launcher's `RANK` is 0
            or unset), so N processes tokenizing alike print one bar, not N.

    Returns:
        The mapped dataset (lazy for an `IterableDataset`).

    Raises:
        ValueError: `ds` is not a dataset, a column is missing or would be overwritten, `batch_size` < 1, or `add_eos`
            with a tokenizer without EOS.
    """
    from datasets import Dataset, IterableDataset

    if not isinstance(ds, (Dataset, IterableDataset)):
        raise ValueError(f"ds must be a datasets.Dataset or IterableDataset, got {type(ds).__name__}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    columns = ds.column_names  # None for an IterableDataset of unknown features
    if columns is not None:
        missing = [c for c in (text_column, *keep_columns) if c not in columns]
        if missing:
            raise ValueError(f"dataset has no column(s) {missing}; columns are {columns}")
        clash = [c for c in ("input_ids", "length") if c in keep_columns]
        if clash:
            raise ValueError(f"keep_columns {clash} would be overwritten by the tokenized output")
    eos = None
    if add_eos:
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise ValueError(
                f"add_eos=True but tokenizer {type(tokenizer).__name__} has no eos_token_id; "
                "set one or pass add_eos=False"
            )

    def encode(batch: dict[str, list]) -> dict[str, list]:
        texts = batch[text_column]
        bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
        if bad:
            raise ValueError(f"column {text_column!r} holds {type(texts[bad[0]]).__name__}, not str, in a row of this batch")
        # verbose=False: no "longer than model_max_length" warning, since nothing is cut.
        ids = tokenizer(texts, add_special_tokens=add_special_tokens, truncation=False, verbose=False)["input_ids"]
        if eos is not None:
            ids = [list(x) + [eos] for x in ids]
        return {"input_ids": ids, "length": [len(x) for x in ids]}

    if columns is not None:
        remove = [c for c in columns if c not in keep_columns]
    else:
        remove = [text_column] if text_column not in keep_columns else []
    kwargs: dict[str, Any] = dict(batched=True, batch_size=batch_size, remove_columns=remove)
    if isinstance(ds, Dataset) and num_proc is not None:
        kwargs["num_proc"] = num_proc
    if progress is None:
        progress = os.environ.get("RANK", "0") in ("", "0")  # torchrun / accelerate launch set it per process
    with _progress_bars(progress):
        return ds.map(encode, **kwargs)


@contextmanager
def _progress_bars(show: bool) -> Iterator[None]:
    """`datasets`' progress bars off inside the block when `show` is False (and they were on),
    restored after; an HF_DATASETS_DISABLE_PROGRESS_BARS setting is left to win."""
    from datasets import config
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if show or are_progress_bars_disabled() or config.HF_DATASETS_DISABLE_PROGRESS_BARS is not None:
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()
