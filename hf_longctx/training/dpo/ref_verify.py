"""`verify_ref_logps=N`: stored reference columns rescored on a sample of pairs and compared.

Where it sits: `LongDPOTrainer` construction (and `evaluate(eval_dataset=...)` while the
reference is held), for a dataset that arrives carrying `ref_chosen_logps` /
`ref_rejected_logps` under `precompute_ref_log_probs=True`; the rescoring is the reference pass
itself (`dpo/precompute.py`: the training collate, the same mesh and memory options) over the
sampled pairs. Guarantees: the same sample on every rank (seeded by `args.seed`); the columns
are refused, naming the pairs that disagree and by how much, when a sum differs from the
rescored one by more than `tolerance(dtype) × (|stored| + completion tokens)`, with the fix.
What it can tell apart is bounded by that tolerance: in fp32 any other model's sums, in bf16
sums that differ by more than about 3 % of (|sum| + tokens)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from hf_longctx.training.dpo.ref_columns import FINGERPRINT, REF_COLUMNS

SHOWN = 4  # pairs named in the refusal; the count says how many more


def sample_pairs(rows: int, count: int, seed: int) -> list[int]:
    """`count` distinct row indices of `rows` (all of them when count >= rows), sorted, the same
    on every rank for the same seed."""
    if count >= rows:
        return list(range(rows))
    return sorted(torch.randperm(rows, generator=torch.Generator().manual_seed(seed))[:count].tolist())


def tolerance(dtype: torch.dtype) -> float:
    """Allowed |stored - rescored| per unit of (|stored sum| + completion tokens) when the reference
    computes in `dtype`. A token's log-prob carries the rounding of its logits in `dtype` (a few
    eps of the logit scale, and Σ|log-prob| = |sum| bounds that scale's sum, the token count its
    log-sum-exp's) plus fp32 accumulation-order error, which grows like √(hidden size) eps (64
    for 4096): 4 eps(dtype) + 64 eps(fp32). fp32 8.1e-6, bf16 0.031, fp16 0.0039. Measured: TRL's
    padded single-process fp32 columns against this pass under Ulysses 2 differ by 1e-7 relative,
    fp32 against bf16 weights by 1e-4 relative (the DPO tests' tiny Llama)."""
    return 4 * torch.finfo(dtype).eps + 64 * torch.finfo(torch.float32).eps


def check_rescored(name: str, rows: list[int], stored: np.ndarray, rescored: np.ndarray, tokens: np.ndarray,
                   dtype: torch.dtype, columns: list[str]) -> None:
    """Raise ValueError naming every sampled pair (dataset row `rows[k]`) whose stored sums
    (float [k, 2]: chosen, rejected) differ from `rescored` beyond the tolerance, given the
    completions' token counts `tokens` [k, 2]; `columns`: the reference columns the dataset
    carries (the fix drops them)."""
    tau = tolerance(dtype)
    allowed = tau * (np.abs(stored) + tokens)  # [k, 2]
    off = np.abs(stored - rescored)  # [k, 2]
    bad = np.flatnonzero((off > allowed).any(axis=1) | ~np.isfinite(stored).all(axis=1))
    if not len(bad):
        return
    sides = ("chosen", "rejected")
    lines = [f"pair {rows[k]}: " + ", ".join(
        f"{side} stored {stored[k, j]:.6g}, rescored {rescored[k, j]:.6g} "
        f"(off by {off[k, j]:.3g}, allowed {allowed[k, j]:.2g})" for j, side in enumerate(sides))
        for k in bad[:SHOWN].tolist()]
    more = f"\n  ... ({len(bad) - SHOWN} more)" if len(bad) > SHOWN else ""
    raise ValueError(
        f"{name}: {len(bad)} of {len(rows)} rescored pairs disagree with the stored {REF_COLUMNS} beyond the "
        f"{str(dtype).removeprefix('torch.')} tolerance ({tau:.2g} x (|stored| + completion tokens)), so they are not "
        "this trainer's reference log-probs of these pairs (another model, another tokenization or template, or "
        "edited):\n  " + "\n  ".join(lines) + more + "\nDo instead: drop them and let the trainer compute them with "
        f"this reference at construction: dataset = dataset.remove_columns({columns}); or pass as ref_model the "
        "model they should come from. (Columns computed in a coarser dtype than the reference runs in, e.g. bf16 "
        "columns against an fp32 reference, differ by that dtype's rounding: recompute them here.)")


def verify_stored(dataset: Any, name: str, *, count: int, seed: int, dtype: torch.dtype,
                  score: Callable[[Any], tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Rescore `count` sampled pairs of `dataset` with `score` (a dataset of pairs -> fp32 [k]
    chosen and rejected sums, identical on every rank) and compare with the stored columns."""
    import pyarrow.compute as pc

    rows = sample_pairs(len(dataset), count, seed)
    sample = dataset.select(rows)
    table = sample.with_format("arrow")
    stored = np.stack([table[c].to_numpy().astype(np.float64) for c in REF_COLUMNS], axis=1)  # [k, 2]
    tokens = np.stack([pc.list_value_length(table[c]).to_numpy() for c in ("chosen_ids", "rejected_ids")], axis=1)
    chosen, rejected = score(sample.select_columns(["prompt_ids", "chosen_ids", "rejected_ids"]))
    rescored = torch.stack([chosen, rejected], dim=1).double().numpy()  # [k, 2]
    columns = [c for c in (*REF_COLUMNS, *FINGERPRINT) if c in dataset.column_names]
    check_rescored(name, rows, stored, rescored, tokens.astype(np.float64), dtype, columns)


def unverified_message(names: list[str]) -> str:
    """The one warning for stored columns without the fingerprint, used as given (TRL's way)."""
    return (f"LongDPOTrainer: {', '.join(names)} carr{'ies' if len(names) == 1 else 'y'} {REF_COLUMNS} without the "
            f"fingerprint the reference pass writes ({', '.join(FINGERPRINT)}), so they could not be verified against "
            "this trainer's reference and are used as given. To verify them, pass LongDPOTrainer(..., "
            "verify_ref_logps=64): 64 sampled pairs are rescored with the reference and columns that disagree are "
            "refused. To have the trainer compute them instead, drop them: "
            f"dataset.remove_columns({list(REF_COLUMNS)})")
