"""Padded rows: the `attention_mask` of a dataset tokenized with padding, read so that only a
row's real tokens become document tokens.

Where it sits: the first stage of the data path that sees a row -- the collators' feature
reading (`data/collator.read_documents`, shared by the fixed-degree and flexible collators; the
multimodal one refuses padding inside a processed document; `flex/step.py`'s documents) and
the trainers' dataset checks and lengths
(`training/sft/data.py`), before any planning. A row padded to a fixed length
(`tokenizer(..., padding="max_length")`, right or left) with its `attention_mask` is ONE
document of its mask-1 tokens; the pads are dropped, since packing makes padding of its own
(DESIGN invariant 5: padding is its own document and carries no loss). Guarantee: the step's
documents, token count, plan and loss equal those of the same rows unpadded. A mask that is
not right or left padding (holes, padding on both sides), values other than 0/1, or a row
without a 1, is refused naming the row.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_longctx.errors import NotSupported

MASK_KEY = "attention_mask"
_FIX = ("make each row one document with its padding at one end (the tokenizer's right or left padding), or drop "
        f"the '{MASK_KEY}' column and pass unpadded rows (the collator packs documents itself; no padding needed)")


def real_span(where: str, mask: torch.Tensor) -> tuple[int, int]:
    """(start, end) of the tokens with mask 1 in one row's 1-D 0/1 `mask`: [0, n) for a
    right-padded row, [p, L) for a left-padded one, [0, L) without padding. `where` names the
    row in the refusals."""
    bad = ((mask != 0) & (mask != 1)).nonzero()
    if len(bad):
        j = int(bad[0, 0])
        raise NotSupported(f"{where}: '{MASK_KEY}' must be 0/1 (1 = a real token, 0 = padding), token {j} has "
                           f"{mask[j].item()!r}", _FIX)
    ones = mask.nonzero().flatten()  # [n] positions of the real tokens
    if not len(ones):
        raise NotSupported(f"{where}: '{MASK_KEY}' has no 1 in its {len(mask)} entries: the row holds no real token",
                           "drop the row (e.g. dataset.filter(lambda row: any(row['attention_mask'])))")
    start, end = int(ones[0]), int(ones[-1]) + 1
    if end - start != len(ones) or (start > 0 and end < len(mask)):
        runs = int((mask[1:] != mask[:-1]).sum()) + 1
        raise NotSupported(
            f"{where}: '{MASK_KEY}' is not right or left padding: its {len(mask)} entries form {runs} runs of 0s and "
            f"1s (first real token at {start}, last at {end - 1}, {len(ones)} real tokens), so the row is not one "
            "document with padding at one end", _FIX,
        )
    return start, end


def masked_lengths(dataset: Any, name: str = "train_dataset") -> list[int]:
    """Real tokens of every row of `dataset`'s `attention_mask` column (a `datasets.Dataset`):
    one vectorised pass over the column (no Python list per row); the first row `real_span`
    would refuse is named the same way, at construction instead of at its step."""
    import numpy as np
    import pyarrow.compute as pc

    lengths: list[int] = []
    offset = 0
    for chunk in dataset.with_format("arrow")[MASK_KEY].chunks:
        flat = np.asarray(pc.list_flatten(chunk).to_numpy(zero_copy_only=False), dtype=np.int64)  # [tokens of the chunk]
        parent = np.asarray(pc.list_parent_indices(chunk).to_numpy(zero_copy_only=False))  # [tokens]: row in the chunk
        ones = np.bincount(parent, weights=(flat == 1), minlength=len(chunk)).astype(np.int64)  # [rows]
        same_row = parent[1:] == parent[:-1]
        # A right- or left-padded row changes value at most once; holes or two-sided padding change more.
        changes = np.bincount(parent[1:][same_row & (flat[1:] != flat[:-1])], minlength=len(chunk))  # [rows]
        bad_value = np.zeros(len(chunk), dtype=bool)
        bad_value[parent[(flat != 0) & (flat != 1)]] = True
        bad = np.nonzero(bad_value | (ones == 0) | (changes > 1))[0]
        if len(bad):
            row = offset + int(bad[0])
            real_span(f"{name} document {row}", torch.as_tensor(dataset[row][MASK_KEY]))  # raises, naming it
        lengths += ones.tolist()
        offset += len(chunk)
    return lengths
