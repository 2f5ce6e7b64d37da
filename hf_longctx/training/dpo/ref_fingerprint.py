"""The fingerprint the reference pass writes beside TRL's stored reference columns, and its check.

Where it sits: written by `dpo/precompute.py` (`with_ref_columns`) and checked by
`LongDPOTrainer` whenever a dataset carrying `ref_chosen_logps` / `ref_rejected_logps` is
given under `precompute_ref_log_probs=True`: at construction (before TRL's preparation and
any collective when the pairs are already tokenized), for a dataset given to `evaluate()`,
and when a step loader is built. Three int64 columns per pair: `ref_ids_hash` (the pair's
token ids), `ref_model_hash` (the scoring reference's `model_digest`) and `ref_logps_hash`
(the two stored float32 sums sealed to both hashes). Guarantees: a row whose ids changed,
whose sums were edited or moved to another row, that was added without a fingerprint, or
whose sums come from another reference is refused, naming the rows and values, with the fix;
whole rows reordered or filtered keep their sums with their ids and stay valid. Host only,
deterministic, so every rank raises alike."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from hf_longctx.training.dpo.ref_columns import FINGERPRINT, IDS_HASH, LOGPS_HASH, MODEL_HASH, REF_COLUMNS

SHOWN = 4  # rows named per problem; the count says how many more


def _ragged(table: Any, column: str) -> tuple[np.ndarray, np.ndarray]:
    """(offsets [N+1], int64 values) of a list column of an arrow-formatted dataset."""
    arr = table[column].combine_chunks()  # one ListArray [N], the dataset's indices applied
    return arr.offsets.to_numpy(), arr.values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def ids_hashes(dataset: Any) -> np.ndarray:
    """[N] int64: `ref_columns.ids_hash` of every pair, read from arrow without Python lists
    (the same bytes: the three lengths, then the prompt, chosen and rejected ids, as int64)."""
    table = dataset.with_format("arrow")
    parts = [_ragged(table, c) for c in ("prompt_ids", "chosen_ids", "rejected_ids")]
    out = np.empty(len(dataset), dtype=np.int64)
    for i in range(len(out)):
        h = hashlib.blake2b(digest_size=8)
        h.update(np.asarray([off[i + 1] - off[i] for off, _ in parts], dtype=np.int64).tobytes())
        for off, values in parts:
            h.update(values[off[i]:off[i + 1]].tobytes())
        out[i] = int.from_bytes(h.digest(), "little", signed=True)
    return out


def logps_hashes(ids: np.ndarray, model: np.ndarray, chosen: np.ndarray, rejected: np.ndarray) -> np.ndarray:
    """[N] int64: each pair's two float32 sums sealed to its ids hash and its reference's digest,
    so an edited sum, or sums moved to another row, no longer match."""
    rec = np.empty(len(ids), dtype=[("ids", "<i8"), ("model", "<i8"), ("chosen", "<f4"), ("rejected", "<f4")])
    rec["ids"], rec["model"], rec["chosen"], rec["rejected"] = ids, model, chosen, rejected
    raw, size = memoryview(rec.tobytes()), rec.dtype.itemsize  # [N x 24 bytes]
    digests = (hashlib.blake2b(raw[i * size:(i + 1) * size], digest_size=8).digest() for i in range(len(ids)))
    return np.asarray([int.from_bytes(d, "little", signed=True) for d in digests], dtype=np.int64)


def fingerprint_columns(dataset: Any, chosen: np.ndarray, rejected: np.ndarray,
                        model_hash: int) -> dict[str, np.ndarray]:
    """The three fingerprint columns of `dataset`'s pairs scored `chosen` / `rejected` (float32 [N])
    by a reference of digest `model_hash`."""
    ids = ids_hashes(dataset)
    model = np.full(len(ids), model_hash, dtype=np.int64)
    return {IDS_HASH: ids, MODEL_HASH: model,
            LOGPS_HASH: logps_hashes(ids, model, np.asarray(chosen, np.float32), np.asarray(rejected, np.float32))}


def _rows(mask: np.ndarray, detail: Any = None) -> str:
    """'2 pairs: pair 2 (detail), pair 5 (detail)', naming at most SHOWN rows."""
    at = np.flatnonzero(mask).tolist()
    shown = [f"pair {i}" + (f" ({detail(i)})" if detail else "") for i in at[:SHOWN]]
    return f"{len(at)} pair{'s' if len(at) > 1 else ''}: " + ", ".join(shown) + (", ..." if len(at) > SHOWN else "")


def check_fingerprint(dataset: Any, name: str, model_hash: int, reference: str) -> bool:
    """True when `dataset` carries the fingerprint and every row matches it; False when it carries
    none (then its columns cannot be checked here). Raises, naming every problem's rows: part of
    the fingerprint missing, rows without one, ids changed, sums edited or moved, sums from
    another reference than `reference` (how the trainer's reference is named in the message),
    whose `model_digest` is `model_hash`."""
    have = [c for c in FINGERPRINT if c in dataset.column_names]
    if not have:
        return False
    present = [c for c in (*REF_COLUMNS, *FINGERPRINT) if c in dataset.column_names]
    drop = f"dataset = dataset.remove_columns({present})"
    recompute = (f"drop the stale columns and let the trainer compute them with this reference at construction "
                 f"(precompute_ref_log_probs=True scores every pair): {drop}")
    if len(have) < len(FINGERPRINT):
        raise ValueError(f"{name} carries {have} but not {[c for c in FINGERPRINT if c not in have]}: the reference "
                         f"pass writes all three beside {REF_COLUMNS}, so these columns were edited. "
                         f"Do instead: {recompute}")
    table = dataset.with_format("arrow")
    cols = {c: table[c].combine_chunks() for c in (*FINGERPRINT, *REF_COLUMNS)}
    null = np.zeros(len(dataset), dtype=bool)
    for arr in cols.values():
        null |= arr.is_null().to_numpy(zero_copy_only=False)
    ids, model, seal = (cols[c].fill_null(0).to_numpy().astype(np.int64) for c in FINGERPRINT)
    chosen, rejected = (cols[c].fill_null(0).to_numpy().astype(np.float32) for c in REF_COLUMNS)
    now = ids_hashes(dataset)
    problems = []
    if null.any():
        problems.append(f"rows without a fingerprint or stored sums (added after the reference pass), {_rows(null)}")
    changed = ~null & (ids != now)
    if changed.any():
        problems.append("token ids that differ from those the stored sums were computed on, "
                        + _rows(changed, lambda i: f"{IDS_HASH} {ids[i]}, its ids now hash to {now[i]}"))
    edited = ~null & (logps_hashes(ids, model, chosen, rejected) != seal)
    if edited.any():
        values = lambda i: f"{REF_COLUMNS[0]} {chosen[i]:.6g}, {REF_COLUMNS[1]} {rejected[i]:.6g}"  # noqa: E731
        problems.append("stored sums edited after the reference pass, or moved to another row, "
                        + _rows(edited, values))
    other = ~null & (model != model_hash)
    if other.any():
        digests = ", ".join(str(v) for v in np.unique(model[other])[:SHOWN].tolist())
        problems.append(f"sums computed by another reference ({MODEL_HASH} {digests}; {reference} digests to "
                        f"{model_hash}), {_rows(other)}")
    if problems:
        fix = recompute
        if other.any() and not (null.any() or changed.any() or edited.any()):
            fix += (f"; or pass as ref_model the model that computed them; or, to train against them unchecked as "
                    f"that model's sums, drop only the fingerprint: dataset.remove_columns({list(FINGERPRINT)}) "
                    "(a warning then says they are unverified)")
        raise ValueError(f"{name}: its stored {REF_COLUMNS} are not valid here (checked against their fingerprint):"
                         + "".join(f"\n  {p}" for p in problems) + f"\nDo instead: {fix}")
    return True
