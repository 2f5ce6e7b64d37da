"""The stored reference columns of TRL's `precompute_ref_log_probs=True`: their names, the
fingerprint of the token ids they were scored on, and the checks that keep them valid.

Where it sits: between the reference pass (`dpo/precompute.py`, which writes the columns) and
every step's collate (`dpo/data.py`, which reads them into the micro-batches under `REF_KEY`).
Guarantees: a dataset with one of TRL's two columns only, or with a format transform (rows
that can change between epochs), is refused before any collective; a row whose token ids no
longer match `IDS_HASH` is refused by the collate, on the host, before the step's collectives
(every rank holds the step's rows and raises alike). The whole fingerprint (`FINGERPRINT`) is
checked when a dataset reaches the trainer (`ref_fingerprint.py`, `stored_ref.py`).
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping, Sequence

import numpy as np

from hf_longctx.data.token_ids import document_name
from hf_longctx.errors import NotSupported

REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")  # TRL's names (DPOTrainer._precompute_ref_logps)
IDS_HASH = "ref_ids_hash"  # the scored token ids' fingerprint, int64 per pair
MODEL_HASH = "ref_model_hash"  # the scoring reference's `model_digest`, int64 per pair
LOGPS_HASH = "ref_logps_hash"  # the two stored sums sealed to their ids and reference, int64 per pair
FINGERPRINT = (IDS_HASH, MODEL_HASH, LOGPS_HASH)  # written by the reference pass, checked by ref_fingerprint.py
REF_KEY = "dpo_ref_logps"  # a micro-batch's [2P] stored sums, chosen/rejected alternating (not a model input)
_FIX = ("apply it once before the trainer (dataset = dataset.map(fn)), so every epoch reads the rows the reference "
        "scored, or set precompute_ref_log_probs=False (the reference then runs on every step's shards)")


def ids_hash(prompt: Sequence[int], chosen: Sequence[int], rejected: Sequence[int]) -> int:
    """A 64-bit fingerprint of one pair's token ids (lengths included, so no two splits collide)."""
    parts = [np.asarray([len(prompt), len(chosen), len(rejected)], dtype=np.int64)]
    parts += [np.asarray(x, dtype=np.int64) for x in (prompt, chosen, rejected)]
    return int.from_bytes(hashlib.blake2b(np.concatenate(parts).tobytes(), digest_size=8).digest(), "little", signed=True)


def stored_columns(dataset: Any, name: str) -> bool:
    """True when `dataset` already carries TRL's two columns (then used as given, once checked); raises when it
    carries one of them only."""
    have = [c for c in REF_COLUMNS if c in dataset.column_names]
    if len(have) == 1:
        raise ValueError(f"{name} carries {have[0]!r} but not its partner ({[c for c in REF_COLUMNS if c not in have][0]!r}): "
                         f"give both {REF_COLUMNS} (e.g. from a TRL DPOTrainer with precompute_ref_log_probs=True) or "
                         "neither (the reference pass computes them)")
    return len(have) == 2


def check_fixed_rows(dataset: Any, name: str) -> None:
    """Refuse, before any collective, a dataset whose rows can change between reads: a format
    transform (`set_transform` / `with_transform`) runs at every access, so a later epoch could
    train on ids the reference never scored."""
    fmt = getattr(dataset, "format", None) or {}
    if fmt.get("type") == "custom":
        fn = fmt.get("format_kwargs", {}).get("transform")
        raise NotSupported(
            f"{name} has a format transform ({getattr(fn, '__name__', type(fn).__name__)}, set by set_transform / "
            "with_transform) that runs at every read; with precompute_ref_log_probs=True the reference scores each "
            "pair once, so rows that change between epochs would train against another pair's reference", _FIX)


def check_rows_scored(rows: Sequence[Mapping[str, Any]]) -> None:
    """Each row's token ids against the fingerprint stored when its reference sums were computed;
    raises naming the first row that differs (host only: every rank holds the step's rows)."""
    for i, row in enumerate(rows):
        name = document_name(row, i)
        now = ids_hash(row["prompt_ids"], row["chosen_ids"], row["rejected_ids"])
        if now != int(row[IDS_HASH]):
            raise ValueError(
                f"{name}: its token ids differ from the ones its stored {REF_COLUMNS} were computed on "
                f"({IDS_HASH} {int(row[IDS_HASH])}, the row now hashes to {now}): the dataset changed after the "
                f"reference pass (precompute_ref_log_probs=True). Do instead: {_FIX}")
