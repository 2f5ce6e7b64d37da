"""Workload-balanced micro-batch planner: documents → DP rank → micro-batches.

Where it sits: after the step sampler (`data/sampler.py`) has drawn the same global
list of documents on every rank and before `data/sharding.py` lays each micro-batch
out over the SP group. Pure NumPy, no communication: every rank computes the same plan
from the same inputs (DESIGN invariant 8).

Which paper sections: the two-stage assignment of Hydraulis (dispatch documents across
data-parallel ranks by estimated time T(l), then pack micro-batches under a memory cap;
its randomised greedy dispatch is `strategy="hydraulis"`), the FlexSP appendix (sort,
then a dynamic programme that cuts the batch into consecutive micro-batches minimising
the largest token sum; `strategy="flexsp"`), token first-fit-decreasing as used by
Megatron/NeMo packing (`"ffd"`) and multi-way Karmarkar-Karp differencing
(`"karmarkar_karp"`); those four live in `packing_baselines.py`. The default
`"balanced"` is this library's own; see `_balanced`.

The objective: with FSDP every rank waits for the slowest one at every micro-batch, so a
step lasts Σ over micro-batch slots of the slowest rank's cost, against the ideal
total cost / dp_size. Memory is the token cap: every micro-batch, padding included,
holds at most `max_tokens` tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np

from .cost import CostModel
from .packing_baselines import (
    _desc_order,
    _ffd,
    _ffd_bins,
    _fill_empty,
    _flexsp,
    _hydraulis,
    _karmarkar_karp,
    _min_max_cuts,  # noqa: F401  (re-exported: tests check the FlexSP dynamic programme here)
    _to_ranks,
)

# Attention and matmul work are equal at 16K tokens (b/a ≈ 12·hidden for a dense
# transformer, so hidden ≈ 1.4K). Pass CostModel.from_config(model.config) for your model.
DEFAULT_COST = CostModel(a=1.0, b=16384.0, c=0.0)
STRATEGIES = ("balanced", "ffd", "karmarkar_karp", "hydraulis", "flexsp")
OVERLONG = ("error", "truncate", "split")


class Piece(NamedTuple):
    """Tokens [start, end) of document `doc`: a whole document unless it was split or
    truncated because it exceeded the micro-batch cap."""

    doc: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def _ceil_to(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclass(frozen=True)
class Plan:
    """`ranks[r][m]`: piece indices of DP rank r's m-th micro-batch, in packing order.

    Every rank has the same number of micro-batches (FSDP runs the same collectives
    on all ranks). A micro-batch is empty only when the step has fewer pieces than
    dp_size × num_microbatches slots; the collator then feeds one padding document.
    Micro-batch slot m is ordered from the costliest slot to the cheapest.
    """

    ranks: list[list[list[int]]]
    pieces: list[Piece]
    max_tokens: int
    doc_multiple: int = 1
    seq_multiple: int = 1
    strategy: str = "balanced"

    def __getitem__(self, rank: int) -> list[list[int]]:
        return self.ranks[rank]

    def __len__(self) -> int:
        return len(self.ranks)

    @property
    def dp_size(self) -> int:
        return len(self.ranks)

    @property
    def num_microbatches(self) -> int:
        return len(self.ranks[0]) if self.ranks else 0

    def padded_length(self, piece: int) -> int:
        """Tokens piece `piece` occupies once padded to `doc_multiple`."""
        return _ceil_to(self.pieces[piece].length, self.doc_multiple)

    def microbatch_tokens(self, rank: int, microbatch: int) -> int:
        """Tokens of one micro-batch, padding included (documents to `doc_multiple`,
        the total to `seq_multiple`)."""
        total = sum(self.padded_length(p) for p in self.ranks[rank][microbatch])
        return _ceil_to(total, self.seq_multiple)

    def stats(self, cost: CostModel | None = None) -> dict[str, float]:
        """Balance figures of this plan under `cost` (default `DEFAULT_COST`).

        A micro-batch costs Σ cost(padded piece length); the padding document that
        rounds the total up to `seq_multiple` is not counted.
        """
        cost = DEFAULT_COST if cost is None else cost
        d, m = self.dp_size, self.num_microbatches
        padded = np.array([self.padded_length(p) for p in range(len(self.pieces))], dtype=np.int64)
        piece_cost = cost(padded) if len(padded) else np.zeros(0)
        mb_cost = np.zeros((d, m))
        mb_tokens = np.zeros((d, m), dtype=np.int64)
        for r in range(d):
            for j, mb in enumerate(self.ranks[r]):
                mb_cost[r, j] = piece_cost[mb].sum() if mb else 0.0
                mb_tokens[r, j] = self.microbatch_tokens(r, j)
        rank_cost = mb_cost.sum(axis=1)
        total = float(rank_cost.sum())
        ideal = total / d
        synced = float(mb_cost.max(axis=0).sum()) if m else 0.0
        mean = float(rank_cost.mean())
        real = int(sum(p.length for p in self.pieces))
        return {
            "dp_size": d,
            "num_microbatches": m,
            "num_pieces": len(self.pieces),
            "rank_cost_max": float(rank_cost.max()),
            "rank_cost_mean": mean,
            "rank_max_over_mean": float(rank_cost.max()) / mean if mean > 0 else 1.0,
            "synced_step": synced,
            "ideal_step": ideal,
            "synced_over_ideal": synced / ideal if ideal > 0 else 1.0,
            "tokens_per_microbatch_max": int(mb_tokens.max()) if m else 0,
            "tokens_per_microbatch_mean": float(mb_tokens.mean()) if m else 0.0,
            "fill": float(mb_tokens.mean()) / self.max_tokens if m else 0.0,
            "padding_tokens": int(mb_tokens.sum()) - real,
        }


def _as_lengths(lengths: Any) -> np.ndarray:
    arr = np.asarray(lengths.tolist() if hasattr(lengths, "tolist") else list(lengths))
    if arr.ndim != 1:
        raise ValueError(f"lengths must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind == "f":
        bad = np.flatnonzero(arr != np.floor(arr))
        if bad.size:
            raise ValueError(f"lengths must be integers: document {bad[0]} has length {arr[bad[0]].item()!r}")
    elif arr.dtype.kind not in "iu":
        raise ValueError(f"lengths must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero(arr < 1)
    if bad.size:
        shown = ", ".join(f"document {i} has length {arr[i]}" for i in bad[:8])
        raise ValueError(f"every document needs at least 1 token: {shown}{' ...' if bad.size > 8 else ''}")
    return arr


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _make_pieces(lengths: np.ndarray, piece_max: int, overlong: str, cap_desc: str) -> list[Piece]:
    over = np.flatnonzero(lengths > piece_max)
    if over.size and overlong == "error":
        shown = ", ".join(f"document {i} has {lengths[i]} tokens" for i in over[:8])
        raise ValueError(
            f"{over.size} document(s) longer than the {piece_max}-token limit of one micro-batch "
            f"({cap_desc}): {shown}{' ...' if over.size > 8 else ''}; "
            'pass overlong="truncate" or overlong="split", or raise max_tokens'
        )
    if not over.size:
        return [Piece(i, 0, int(n)) for i, n in enumerate(lengths.tolist())]
    pieces = []
    for i, n in enumerate(lengths.tolist()):
        if n <= piece_max:
            pieces.append(Piece(i, 0, n))
        elif overlong == "truncate":
            pieces.append(Piece(i, 0, piece_max))
        else:
            pieces.extend(Piece(i, s, min(s + piece_max, n)) for s in range(0, n, piece_max))
    return pieces


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
) -> Plan:
    """Assign every document of one step to a DP rank and a micro-batch.

    `lengths[i]` is document i's token count; `max_tokens` is what one SP group holds in
    one micro-batch, padding included: each document is padded to a multiple of
    `doc_multiple` and the micro-batch total rounded up to a multiple of `seq_multiple`.
    A document that cannot fit alone raises ValueError naming it, unless
    `overlong="truncate"` (keep its first tokens) or `"split"` (consecutive pieces
    trained as separate documents). The plan is a pure function of the arguments.

    Strategies: `"balanced"` (default; see `_balanced`) minimises the synchronised step
    time Σ over slots of the slowest rank's cost, with at most one micro-batch more than
    ⌈(bins token FFD needs) / dp_size⌉; `"ffd"`, `"karmarkar_karp"`, `"hydraulis"` and
    `"flexsp"` are the published baselines, for comparison (`"karmarkar_karp"`,
    `"hydraulis"` and `"flexsp"` may use more micro-batches). `seed` drives the
    randomised `"hydraulis"` dispatch only. Micro-batch costs use each piece's padded
    length.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if overlong not in OVERLONG:
        raise ValueError(f"overlong must be one of {OVERLONG}, got {overlong!r}")
    dp_size = _check_int("dp_size", dp_size, 1)
    max_tokens = _check_int("max_tokens", max_tokens, 1)
    doc_multiple = _check_int("doc_multiple", doc_multiple, 1)
    seq_multiple = _check_int("seq_multiple", seq_multiple, 1)
    seed = _check_int("seed", seed, 0)
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
    pieces = _make_pieces(_as_lengths(lengths), piece_max, overlong, cap_desc)

    raw = np.fromiter((p.length for p in pieces), dtype=np.int64, count=len(pieces))
    sizes = -(-raw // doc_multiple) * doc_multiple
    costs = np.asarray(cost(sizes), dtype=np.float64) if len(pieces) else np.zeros(0)
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
    return len(_ffd_bins(np.asarray(sizes, dtype=np.int64), cap))


def microbatch_bound(plan: Plan) -> int:
    """The most micro-batches per rank the contract allows for this plan's pieces:
    ⌈(bins token FFD needs) / dp_size⌉ + 1."""
    cap = plan.max_tokens // plan.seq_multiple * plan.seq_multiple
    sizes = [plan.padded_length(p) for p in range(len(plan.pieces))]
    return math.ceil(ffd_bin_count(sizes, cap) / plan.dp_size) + 1


# --------------------------------------------------------------------------- default strategy
# Bins are lists of piece indices; `sizes` are padded token counts, `costs` T(size).
# Token FFD, empty-bin filling and dealing slots to ranks are shared with the baselines
# and live in packing_baselines.py.


def _slots_by_cost(bins: list[list[int]], costs: np.ndarray, dp_size: int) -> list[list[list[int]]]:
    """Sort bins by cost and cut them into consecutive groups of dp_size: for a fixed set
    of bins this minimises Σ over slots of the slot's costliest bin."""
    load = np.array([costs[b].sum() if b else 0.0 for b in bins])
    first = np.array([min(b) if b else len(costs) for b in bins])
    order = np.lexsort((first, -load)).tolist()
    return [[bins[k] for k in order[m : m + dp_size]] for m in range(0, len(order), dp_size)]


def _cost_fill(sizes, costs, cap, dp_size, m, order, max_slots):
    """Place pieces, costliest first, into dp_size × m bins grouped in m slots.

    Each piece goes to the bin with room whose projected cost lies furthest below its
    slot's maximum (the bin where it raises Σ of slot maxima least; an empty slot has
    nothing below its maximum, so it is used only when no open slot can absorb the
    piece), ties to the lighter bin. Costly pieces thereby line up in the same slot across ranks and
    cheap ones fill the gaps under each slot's maximum. When a piece finds no bin with
    room, one more slot opens (up to `max_slots`; None beyond).
    """
    k_bins = dp_size * m
    # A bin is judged by its projected cost, as if its free room were topped up with the
    # cheapest filler per token (rho): bins nearly always end full, so a bin holding one
    # dense document already "is" costlier than a bin holding a sparse one.
    rho = float((costs / sizes).min())
    load = np.zeros(k_bins)
    room = np.full(k_bins, cap, dtype=np.int64)
    slot_max = np.full(m, rho * cap)  # every slot starts as empty, projected-full bins
    head = np.zeros(k_bins)  # slot maximum minus the bin's projected cost
    bins: list[list[int]] = [[] for _ in range(k_bins)]
    neg_inf = -np.inf
    for i in order.tolist():
        s, c = int(sizes[i]), float(costs[i])
        masked = np.where(room >= s, head, neg_inf)
        k = int(masked.argmax())
        best = masked[k]
        if best == neg_inf:
            if m == max_slots:
                return None
            # Out of room: open one more slot and carry on rather than start over; the
            # pieces left are the cheapest, so the new slot only collects small ones.
            m += 1
            load, room, head = (np.concatenate([a, np.full(dp_size, v, dtype=a.dtype)])
                                for a, v in ((load, 0.0), (room, cap), (head, 0.0)))
            slot_max = np.append(slot_max, rho * cap)
            bins += [[] for _ in range(dp_size)]
            k = len(bins) - dp_size
        else:
            cand = np.flatnonzero(masked == best)
            if cand.size > 1:
                k = int(cand[np.argmin(load[cand])])
        bins[k].append(i)
        room[k] -= s
        load[k] += c
        proj = load[k] + rho * room[k]
        j = k // dp_size
        if proj > slot_max[j]:
            head[j * dp_size : (j + 1) * dp_size] += proj - slot_max[j]
            slot_max[j] = proj
        head[k] = slot_max[j] - proj
    return bins


def _balanced(sizes, costs, cap, dp_size, seed):
    """The default. Think of the step as a grid: `m` micro-batch slots × dp_size ranks,
    each cell a bin of `cap` tokens; the step costs Σ over slots of the slot's costliest
    bin. So costly documents must share a slot with equally costly bins on the other
    ranks, and cheap ones must even out the rest.

    1. m = ⌈(bins token FFD needs) / dp_size⌉: no more micro-batches than memory needs.
    2. `_cost_fill`: costliest piece first, each into the bin where it raises Σ of slot
       maxima least (judging bins by projected full cost), opening one extra slot only
       if some piece finds no room (the contract allows m + 1).
    3. Empty bins take the cheapest pieces of bins holding several.
    4. `_improve`: moves and swaps that lower Σ of slot maxima.
    5. Bins sorted by cost and cut into slots of dp_size (optimal for fixed bins), then
       dealt to ranks to even out per-rank totals (`_to_ranks`).
    `seed` is unused: the plan is deterministic without randomness.
    """
    base = math.ceil(len(_ffd_bins(sizes, cap)) / dp_size)
    order = _desc_order(sizes, costs)
    bins = _cost_fill(sizes, costs, cap, dp_size, base, order, max_slots=base + 1)
    if bins is None:  # token FFD always fits `base` slots; balance it afterwards
        bins = _ffd_bins(sizes, cap)
        bins += [[] for _ in range(base * dp_size - len(bins))]
    bins = _fill_empty(bins, costs)
    if dp_size > 1:
        bins = _improve(bins, sizes, costs, cap, dp_size)
    return _to_ranks(_slots_by_cost(bins, costs, dp_size), costs, dp_size)


def _improve(bins, sizes, costs, cap, dp_size, max_changes=None, work=20_000_000):
    """Local search on Σ of slot maxima: relieve each slot's costliest bin by moving
    one of its pieces to another bin, or swapping it with a cheaper piece, wherever that
    lowers the sum (slots re-formed by cost after every change).

    Bounded by `max_changes` and by `work` (candidate pairs evaluated), never by wall
    time, so every rank stops at the same point.
    """
    k_bins, n = len(bins), len(sizes)
    bin_of = np.empty(n, dtype=np.int64)
    for k, b in enumerate(bins):
        bin_of[b] = k
    load = np.bincount(bin_of, weights=costs, minlength=k_bins)
    tok = np.bincount(bin_of, weights=sizes, minlength=k_bins).astype(np.int64)
    # Gains below this are not worth a pass (and keep float noise from cycling).
    tol = 1e-4 * costs.sum() / dp_size
    max_changes = 4 * k_bins if max_changes is None else max_changes
    all_bins = np.arange(k_bins)
    for _ in range(max_changes):
        order = np.lexsort((all_bins, -load))
        slot_of = np.empty(k_bins, dtype=np.int64)
        slot_of[order] = all_bins // dp_size
        top, second = load[order[::dp_size]], load[order[1::dp_size]]
        best = (-tol, None)
        for m in np.argsort(second - top, kind="stable").tolist():
            tau, tau2, b = top[m], second[m], int(order[m * dp_size])
            if tau - tau2 <= tol:
                break
            xs = np.flatnonzero(bin_of == b)
            work -= len(xs) * (k_bins + n)
            if work < 0:
                break
            cx, sx = costs[xs][:, None], sizes[xs][:, None]
            relief = np.maximum(tau - cx, tau2) - tau  # change of this slot's maximum
            # Moves: piece x into bin k.
            raise_k = np.maximum(load + cx - top[slot_of], 0.0)
            same = slot_of == m
            delta = np.where(same, np.maximum(np.maximum(tau - cx, tau2), load + cx) - tau, relief + raise_k)
            delta[(tok + sx > cap) | (all_bins == b)] = np.inf
            i, k = np.unravel_index(int(np.argmin(delta)), delta.shape)
            if delta[i, k] < best[0]:
                best = (delta[i, k], (int(xs[i]), None, k))
            # Swaps: piece x with a cheaper piece y of another bin.
            ky = bin_of
            d = cx - costs[None, :]
            new_b = tau - d
            other = np.maximum(load[ky] + d - top[slot_of[ky]], 0.0)
            delta = np.where(
                same[ky], np.maximum(np.maximum(new_b, tau2), load[ky] + d) - tau, np.maximum(new_b, tau2) - tau + other
            )
            bad = (d <= 0) | (ky == b) | (tok[b] - sx + sizes[None, :] > cap) | (tok[ky] + sx - sizes[None, :] > cap)
            delta[bad] = np.inf
            i, y = np.unravel_index(int(np.argmin(delta)), delta.shape)
            if delta[i, y] < best[0]:
                best = (delta[i, y], (int(xs[i]), int(y), int(ky[y])))
        if best[1] is None:
            break
        x, y, k = best[1]
        b = int(bin_of[x])
        for piece, src, dst in ((x, b, k), (y, k, b)):
            if piece is None:
                continue
            bin_of[piece] = dst
            load[src] -= costs[piece]
            load[dst] += costs[piece]
            tok[src] -= sizes[piece]
            tok[dst] += sizes[piece]
        if work < 0:
            break
    return [np.flatnonzero(bin_of == k).tolist() for k in range(k_bins)]


def _run_strategy(strategy, sizes, costs, *, cap, dp_size, seed):
    if len(sizes) == 0:
        return [[] for _ in range(dp_size)]
    fn = {
        "balanced": _balanced,
        "ffd": _ffd,
        "karmarkar_karp": _karmarkar_karp,
        "hydraulis": _hydraulis,
        "flexsp": _flexsp,
    }[strategy]
    return fn(sizes, costs, cap, dp_size, seed)
