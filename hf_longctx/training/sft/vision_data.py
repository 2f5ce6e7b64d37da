"""TRL's conversational image datasets -> rows of processor outputs, for the multimodal step collator.

Where it sits: construction of the Trainer path, for an image-text-to-text model under TRL's
`SFTTrainer` with a processor. The step sampler needs every document's token count up front
and the multimodal collator packs documents with their own images, so each example runs once,
alone, through TRL's SAME `DataCollatorForVisionLanguageModeling` (chat template, processor,
assistant-only / completion-only labels as TRL builds them) and is kept as one row:
`input_ids`, `labels`, pixel / grid tensors, `length`. Nothing is truncated: TRL's
`max_length` must be None (the cap is `max_tokens`; longer documents with images are refused
by the collator). For very large image sets, process the dataset into these columns yourself."""

from __future__ import annotations

from typing import Any

import torch

_PER_TOKEN = ("input_ids", "labels", "mm_token_type_ids", "token_type_ids")


def _row(collate: Any, example: dict, keys: tuple[str, ...]) -> dict:
    out = collate([dict(example)])  # TRL pops / rewrites keys of the example it is given
    row: dict = {k: None for k in keys}
    for key, value in out.items():
        if not isinstance(value, torch.Tensor) or key == "attention_mask":
            continue
        if key in _PER_TOKEN:
            if value.shape[0] != 1:
                raise ValueError(f"the collator returned '{key}' of shape {tuple(value.shape)} for one example")
            row[key] = value[0].tolist()
        else:
            row[key] = value.tolist()
    if "attention_mask" in out and not bool(out["attention_mask"].bool().all()):
        raise ValueError("the collator padded a single example; processor outputs must hold one document without padding")
    row["length"] = len(row["input_ids"])
    return row


def process_examples(dataset: Any, collate: Any, input_keys: frozenset) -> Any:
    """`dataset` (raw `messages` / `images` rows) mapped through `collate` one example at a time."""
    if "input_ids" in dataset.column_names:
        return dataset  # already processor rows
    if getattr(collate, "max_length", None) is not None:
        raise ValueError(
            f"the vision collator truncates to max_length={collate.max_length}, which would cut image tokens; pass "
            "max_length=None (the cap is the trainer's max_tokens)"
        )
    keys = tuple(sorted({"input_ids", "labels", *input_keys, *_PER_TOKEN}))
    rows = dataset.map(lambda ex: _row(collate, ex, keys), remove_columns=dataset.column_names)
    empty = [k for k in keys if all(v is None for v in rows[k])]
    return rows.remove_columns(empty) if empty else rows


def processed_dataset(dataset: Any, collate: Any, spec: Any) -> Any:
    """A raw conversational image dataset as processor rows, through TRL's vision collator
    `collate` (one example at a time); a dataset that already has `input_ids` (or None) as is."""
    if dataset is None or "input_ids" in getattr(dataset, "column_names", ["input_ids"]):
        return dataset
    if not callable(getattr(collate, "torch_call", None)) or not hasattr(collate, "processor"):
        raise ValueError(
            f"the dataset has no 'input_ids' (columns {dataset.column_names}) and the trainer has no vision collator "
            "to process it: use TRL's SFTTrainer with a processor as processing_class, or map the dataset through "
            "the processor yourself (one document per row: input_ids, pixel_values, grids, labels)"
        )
    return process_examples(dataset, collate, spec.input_keys)
