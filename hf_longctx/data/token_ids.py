"""Token ids against the model's vocabulary, checked on the host before any collective.

Where it sits: in the collators' feature reading (`data/collator.read_documents`, shared by
the fixed-degree and flexible collators) and in the DPO pair collate, after the step sampler
and before planning, sharding or any forward. Every rank reads the same global list, so
every rank finds the same bad id and raises the same error together (invariant 8), instead
of one rank failing mid-forward (IndexError, device-side assert) while its peers hang in a
collective. A host comparison per document: no device synchronisation on any step."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hf_longctx.errors import NotSupported

# The feature key under which the step DataLoader names a feature's source row ("train_dataset
# document 17"); the collators read nothing else from it.
DOCUMENT_KEY = "_hf_longctx_document"
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Vocabulary:
    """What token ids the model accepts: `input_ids` in [0, embedding rows), labels -100 or in
    [0, LM-head logits)."""

    embedding_rows: int
    logits: int

    def __post_init__(self) -> None:
        for name in ("embedding_rows", "logits"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Vocabulary.{name} must be a positive int, got {value!r}")


_FIX_IDS = (
    "tokenize with the model's own tokenizer (AutoTokenizer.from_pretrained on the model's path); if the tokenizer "
    "gained tokens, call model.resize_token_embeddings(len(tokenizer)) before patch(); negative ids are never valid "
    "input ids (-100 belongs in labels only); or drop the document from the dataset"
)
_FIX_LABELS = (
    "labels are HF's unshifted per-token targets: a token id of the model's vocabulary, or -100 for no loss; fix the "
    "labels column (or drop it: the input ids are then the targets)"
)


def _first_bad(values: torch.Tensor, limit: int, allow_ignore: bool) -> tuple[int, int, int] | None:
    """(position, value, count) of the values outside [0, limit) (-100 allowed when
    `allow_ignore`), or None; `values` is a 1-D host tensor."""
    bad = (values < 0) | (values >= limit)  # [L] bool
    if allow_ignore:
        bad &= values != IGNORE_INDEX
    if not bool(bad.any()):
        return None
    pos = int(bad.nonzero()[0, 0])
    return pos, int(values[pos]), int(bad.sum())


def check_token_ids(ids: torch.Tensor, labels: torch.Tensor | None, vocab: Vocabulary, where: str) -> None:
    """Raise `NotSupported` naming `where` (the document), the position and the id when an input
    id lies outside [0, embedding rows) or a label is neither -100 nor a class of the LM head."""
    found = _first_bad(ids, vocab.embedding_rows, allow_ignore=False)
    if found is not None:
        pos, value, count = found
        raise NotSupported(
            f"{where}, position {pos}: input_ids holds token id {value}, outside the model's embedding table of "
            f"{vocab.embedding_rows} rows (valid ids 0..{vocab.embedding_rows - 1}); {count} token(s) of this document "
            "are out of range. Checked before any forward: every rank raises this together",
            _FIX_IDS,
        )
    if labels is None:
        return
    found = _first_bad(labels, vocab.logits, allow_ignore=True)
    if found is not None:
        pos, value, count = found
        raise NotSupported(
            f"{where}, position {pos}: labels holds {value}, neither -100 (no loss) nor a class of the LM head's "
            f"{vocab.logits} logits (0..{vocab.logits - 1}); {count} label(s) of this document are out of range",
            _FIX_LABELS,
        )


def document_name(feature: object, index: int) -> str:
    """How an error names a feature: its source row when the step DataLoader recorded it
    ("train_dataset document 17"), else its place in the step's list ("feature 3")."""
    named = feature.get(DOCUMENT_KEY) if isinstance(feature, Mapping) else None
    return str(named) if named is not None else f"feature {index}"
