"""Workload-balanced micro-batch planner: documents → DP rank → micro-batches.

Where it sits: after the step sampler has drawn the same global list on every rank, before
`data/sharding.py` lays each micro-batch out over the SP group. Pure NumPy, no
communication: every rank computes the same plan (invariant 8).
Objective: the step lasts Σ over micro-batch slots of the slowest rank's cost (FSDP waits
at every micro-batch), against total cost / dp_size; every micro-batch, padding included,
holds at most `max_tokens` tokens. Strategies: `"balanced"` (default, `balanced.py`);
Hydraulis' two-stage assignment, the FlexSP appendix's chunking, token FFD and
Karmarkar-Karp (`packing_baselines.py`). The plan is `plan.py`; lengths and the overlong
rule are `pieces.py`."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from hf_longctx.data.balanced import balanced
from hf_longctx.data.cost import DEFAULT_COST, CostModel
from hf_longctx.data.packing_baselines import ffd, ffd_bins, flexsp, hydraulis, karmarkar_karp
from hf_longctx.data.pieces import OVERLONG, as_lengths, check_int, make_pieces
from hf_longctx.data.plan import Plan

STRATEGIES = ("balanced", "ffd", "karmarkar_karp", "hydraulis", "flexsp")


def plan_microbatches(
    lengths: Sequence[int] | np.ndarray,
    *,
    dp_size: int,
    max_tokens: int,
    cost: CostModel | None = None,
    seed: int = 0,
    strategy: str = "balanced",
    overlong: str = "error",
    doc_multiple: int = 1,
    seq_multiple: int = 1,
    extra_costs: Sequence[float] | np.ndarray | None = None,
) -> Plan:
    """Assign every document of one step to a DP rank and a micro-batch: a pure function of the arguments.

    Args:
        lengths: `lengths[i]` is document i's token count.
        dp_size: Data-parallel ranks (SP groups) to assign micro-batches to.
        max_tokens: What one SP group holds in one micro-batch, padding included.
        cost: The per-document cost T(l) (default: `DEFAULT_COST`), of each piece's padded length.
        seed: Drives the randomised `"hydraulis"` dispatch only.
        strategy: `"balanced"` (see `balanced`) minimises the synchronised step time Σ over slots of the slowest
            rank's cost, with at most one micro-batch more than ⌈(bins token FFD needs) / dp_size⌉; `"ffd"`,
            `"karmarkar_karp"`, `"hydraulis"`, `"flexsp"`: the published baselines (the last three may use more).
        overlong: What to do with a document that cannot fit alone: `"error"` (raise, naming it), `"truncate"` (keep
            its first tokens) or `"split"` (consecutive pieces trained as separate documents).
        doc_multiple: Each document is padded to a multiple of this.
        seq_multiple: The micro-batch total is rounded up to a multiple of this.
        extra_costs: `extra_costs[i]`: document i's work its length does not show, in `cost`'s unit (image encoding).

    Returns:
        The step's plan: every DP rank's micro-batches, the same number on every rank.

    Raises:
        ValueError: A document that cannot fit alone under `overlong="error"` (named), or an argument out of range.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if overlong not in OVERLONG:
        raise ValueError(f"overlong must be one of {OVERLONG}, got {overlong!r}")
    dp_size = check_int("dp_size", dp_size, 1)
    max_tokens = check_int("max_tokens", max_tokens, 1)
    doc_multiple = check_int("doc_multiple", doc_multiple, 1)
    seq_multiple = check_int("seq_multiple", seq_multiple, 1)
    seed = check_int("seed", seed, 0)
    cost = DEFAULT_COST if cost is None else cost
    if not isinstance(cost, CostModel):
        raise ValueError(f"cost must be a CostModel, got {type(cost).__name__}")
    if max_tokens < seq_multiple:
        raise ValueError(f"max_tokens ({max_tokens}) must be >= seq_multiple ({seq_multiple})")
    # Capacity left for padded documents once the total is rounded up to seq_multiple.
    cap = max_tokens // seq_multiple * seq_multiple
    if cap < doc_multiple:
        raise ValueError(
            f"max_tokens ({max_tokens}) rounded down to seq_multiple ({seq_multiple}) is {cap}, "
            f"smaller than doc_multiple ({doc_multiple}): no document fits"
        )
    piece_max = cap // doc_multiple * doc_multiple
    cap_desc = f"max_tokens {max_tokens}, doc_multiple {doc_multiple}, seq_multiple {seq_multiple}"
    pieces = make_pieces(as_lengths(lengths), piece_max, overlong, cap_desc)

    raw = np.fromiter((p.length for p in pieces), dtype=np.int64, count=len(pieces))
    sizes = -(-raw // doc_multiple) * doc_multiple
    costs = np.asarray(cost(sizes), dtype=np.float64) if len(pieces) else np.zeros(0)
    if extra_costs is not None:
        extra = np.asarray(extra_costs, dtype=np.float64).ravel()
        n_docs = len(as_lengths(lengths))
        if extra.size != n_docs or not np.all(np.isfinite(extra)) or np.any(extra < 0):
            raise ValueError(f"extra_costs must hold one finite non-negative cost per document ({n_docs}), got {extra.size}")
        doc_len = np.asarray(as_lengths(lengths), dtype=np.float64)
        costs = costs + np.array([extra[p.doc] * p.length / max(doc_len[p.doc], 1.0) for p in pieces], dtype=np.float64)
    ranks = _run_strategy(strategy, sizes, costs, cap=cap, dp_size=dp_size, seed=seed)
    return Plan(
        ranks=ranks,
        pieces=pieces,
        max_tokens=max_tokens,
        doc_multiple=doc_multiple,
        seq_multiple=seq_multiple,
        strategy=strategy,
    )


def ffd_bin_count(sizes: Sequence[int] | np.ndarray, cap: int) -> int:
    """Bins token first-fit-decreasing needs for these (padded) sizes under `cap`;
    the planner allows at most ⌈this / dp_size⌉ + 1 micro-batches per rank."""
    return len(ffd_bins(np.asarray(sizes, dtype=np.int64), cap))


def microbatch_bound(plan: Plan) -> int:
    """The most micro-batches per rank the contract allows for this plan's pieces:
    ⌈(bins token FFD needs) / dp_size⌉ + 1."""
    cap = plan.max_tokens // plan.seq_multiple * plan.seq_multiple
    sizes = [plan.padded_length(p) for p in range(len(plan.pieces))]
    return math.ceil(ffd_bin_count(sizes, cap) / plan.dp_size) + 1


def _run_strategy(strategy, sizes, costs, *, cap, dp_size, seed):
    if len(sizes) == 0:
        return [[] for _ in range(dp_size)]
    fn = {
        "balanced": balanced,
        "ffd": ffd,
        "karmarkar_karp": karmarkar_karp,
        "hydraulis": hydraulis,
        "flexsp": flexsp,
    }[strategy]
    return fn(sizes, costs, cap, dp_size, seed)
