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
(`"karmarkar_karp"`). The default `"balanced"` is this library's own; see `_balanced`.

The objective: with FSDP every rank waits for the slowest one at every micro-batch, so a
step lasts Σ over micro-batch slots of the slowest rank's cost, against the ideal
total cost / dp_size. Memory is the token cap: every micro-batch, padding included,
holds at most `max_tokens` tokens.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np

from .cost import CostModel

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


# --------------------------------------------------------------------------- shared steps
# Bins are lists of piece indices; `sizes` are padded token counts, `costs` T(size).


def _desc_order(sizes: np.ndarray, costs: np.ndarray) -> np.ndarray:
    """Pieces by cost, then size, descending; ties by index so every rank agrees."""
    return np.lexsort((np.arange(len(sizes)), -sizes, -costs))


def _ffd_bins(sizes: np.ndarray, cap: int) -> list[list[int]]:
    """Token first-fit-decreasing: each piece, longest first, into the first bin with room."""
    free = np.empty(len(sizes), dtype=np.int64)
    bins: list[list[int]] = []
    for i in np.lexsort((np.arange(len(sizes)), -sizes)).tolist():
        s = int(sizes[i])
        if bins:
            k = int(np.argmax(free[: len(bins)] >= s))
            if free[k] >= s:
                free[k] -= s
                bins[k].append(i)
                continue
        free[len(bins)] = cap - s
        bins.append([i])
    return bins


def _fill_empty(bins: list[list[int]], costs: np.ndarray) -> list[list[int]]:
    """Give every empty bin the cheapest piece of any bin holding several (from the
    costliest such bin on ties): a small piece disturbs the balance least.

    Every piece fits a bin alone, so this keeps the cap; afterwards a bin is empty only
    when there are fewer pieces than bins.
    """
    empty = [k for k, b in enumerate(bins) if not b]
    if not empty:
        return bins
    load = np.array([costs[b].sum() if b else 0.0 for b in bins])
    bin_of = {p: k for k, b in enumerate(bins) for p in b}
    pieces = sorted(bin_of, key=lambda p: (costs[p], -load[bin_of[p]], p))
    at = 0
    for k in empty:
        while at < len(pieces) and len(bins[bin_of[pieces[at]]]) < 2:
            at += 1  # bins only lose pieces here, so a skipped piece stays unusable
        if at == len(pieces):
            break
        piece = pieces[at]
        at += 1
        bins[bin_of[piece]].remove(piece)
        bins[k].append(piece)
    return bins


def _slots_by_cost(bins: list[list[int]], costs: np.ndarray, dp_size: int) -> list[list[list[int]]]:
    """Sort bins by cost and cut them into consecutive groups of dp_size: for a fixed set
    of bins this minimises Σ over slots of the slot's costliest bin."""
    load = np.array([costs[b].sum() if b else 0.0 for b in bins])
    first = np.array([min(b) if b else len(costs) for b in bins])
    order = np.lexsort((first, -load)).tolist()
    return [[bins[k] for k in order[m : m + dp_size]] for m in range(0, len(order), dp_size)]


def _to_ranks(slots: list[list[list[int]]], costs: np.ndarray, dp_size: int) -> list[list[list[int]]]:
    """Hand each slot's bins to ranks so per-rank totals even out: slots with the widest
    spread first, their costliest bin to the rank with the smallest total so far."""
    loads = [np.array([costs[b].sum() if b else 0.0 for b in slot]) for slot in slots]
    spread = np.array([l.max() - l.min() for l in loads])
    totals = np.zeros(dp_size)
    ranks: list[list[list[int]]] = [[[] for _ in slots] for _ in range(dp_size)]
    for m in np.lexsort((np.arange(len(slots)), -spread)).tolist():
        to = np.lexsort((np.arange(dp_size), totals))
        for k, r in zip(np.lexsort((np.arange(dp_size), -loads[m])).tolist(), to.tolist()):
            ranks[r][m] = sorted(slots[m][k])
            totals[r] += loads[m][k]
    return ranks


def _per_rank_ranks(per_rank: list[list[int]], sizes: np.ndarray, costs: np.ndarray, cap: int) -> list[list[list[int]]]:
    """Second stage of the dispatch-first strategies: token-FFD each rank's pieces into
    micro-batches, pad every rank to the same count, costliest micro-batch first."""
    packed = [[[int(idx[i]) for i in b] for b in _ffd_bins(sizes[idx], cap)]
              for idx in (np.asarray(p, dtype=np.int64) for p in per_rank)]
    m = max((len(b) for b in packed), default=0)
    flat = _fill_empty([b for bins in packed for b in bins + [[] for _ in range(m - len(bins))]], costs)
    out = []
    for r in range(len(per_rank)):
        bins = flat[r * m : (r + 1) * m]
        load = np.array([costs[b].sum() if b else 0.0 for b in bins])
        out.append([sorted(bins[k]) for k in np.lexsort((np.arange(m), -load)).tolist()])
    return out


# --------------------------------------------------------------------------- strategies


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


def _ffd(sizes, costs, cap, dp_size, seed):
    """Megatron/NeMo-style: token FFD bins, dealt to ranks round-robin in bin order."""
    bins = _ffd_bins(sizes, cap)
    m = math.ceil(len(bins) / dp_size)
    bins = _fill_empty(bins + [[] for _ in range(m * dp_size - len(bins))], costs)
    return [[sorted(bins[j * dp_size + r]) for j in range(m)] for r in range(dp_size)]


def _karmarkar_karp(sizes, costs, cap, dp_size, seed):
    """Multi-way largest differencing on cost across ranks (no token cap), then each
    rank's pieces token-FFD packed into micro-batches."""
    # A partial partition is dp_size subsets kept sorted by cost, descending; subsets are
    # nested tuples so that merging is O(1) and flattening happens once at the end.
    heap = []
    for i in _desc_order(sizes, costs).tolist():
        sums = [float(costs[i])] + [0.0] * (dp_size - 1)
        items = [(i,)] + [()] * (dp_size - 1)
        heap.append((-sums[0], i, sums, items))
    heapq.heapify(heap)
    while len(heap) > 1:
        _, t1, s1, it1 = heapq.heappop(heap)
        _, t2, s2, it2 = heapq.heappop(heap)
        # Largest subset of one with the smallest of the other cancels the difference.
        merged = sorted(
            ((s1[j] + s2[dp_size - 1 - j], (it1[j], it2[dp_size - 1 - j])) for j in range(dp_size)),
            key=lambda t: -t[0],
        )
        sums = [t[0] for t in merged]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), min(t1, t2), sums, [t[1] for t in merged]))
    per_rank = [_flatten(t) for t in heap[0][3]]
    return _per_rank_ranks(per_rank, sizes, costs, cap)


def _flatten(tree) -> list[int]:
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, tuple):
            stack.extend(node)
        else:
            out.append(node)
    return sorted(out)


def _hydraulis(sizes, costs, cap, dp_size, seed, trials=8, jitter=0.05):
    """Randomised greedy dispatch (Hydraulis stage 1): pieces in a jittered costliest-first
    order, each to the least-loaded rank whose token budget (what token FFD would give it)
    still has room, best of `trials` seeded orders by max rank cost; then stage 2 packs
    each rank's micro-batches under the token cap."""
    budget = math.ceil(len(_ffd_bins(sizes, cap)) / dp_size) * cap
    rng = np.random.default_rng(seed)
    best = None
    for _ in range(trials):
        key = costs * (1.0 + jitter * rng.uniform(-1.0, 1.0, size=len(costs)))
        load, tok = np.zeros(dp_size), np.zeros(dp_size, dtype=np.int64)
        per_rank: list[list[int]] = [[] for _ in range(dp_size)]
        for i in np.lexsort((np.arange(len(costs)), -key)).tolist():
            room = tok + sizes[i] <= budget
            r = int(np.argmin(np.where(room, load, np.inf))) if room.any() else int(np.argmin(tok))
            per_rank[r].append(i)
            load[r] += costs[i]
            tok[r] += sizes[i]
        if best is None or load.max() < best[0]:
            best = (load.max(), per_rank)
    return _per_rank_ranks(best[1], sizes, costs, cap)


def _flexsp(sizes, costs, cap, dp_size, seed):
    """FlexSP appendix: sort by length, cut into m consecutive micro-batch steps by the
    dynamic programme minimising the largest token sum, then spread each step over the
    ranks (costliest piece to the cheapest rank with room); m grows until every step
    packs into dp_size bins."""
    order = np.lexsort((np.arange(len(sizes)), -sizes))
    m = math.ceil(len(_ffd_bins(sizes, cap)) / dp_size)
    while True:
        cuts = _min_max_cuts(sizes[order], min(m, len(order)))
        slots = []
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            slot = _spread(order[lo:hi], sizes, costs, cap, dp_size)
            if slot is None:
                break
            slots.append(slot)
        else:
            slots += [[[] for _ in range(dp_size)] for _ in range(m - len(slots))]
            flat = _fill_empty([b for slot in slots for b in slot], costs)
            slots = [flat[j * dp_size : (j + 1) * dp_size] for j in range(m)]
            return _to_ranks(slots, costs, dp_size)
        m += 1


def _min_max_cuts(x: np.ndarray, m: int) -> list[int]:
    """Boundaries cutting x into m consecutive non-empty groups with the smallest largest
    sum: dp[k][i] = min_j max(dp[k-1][j], sum x[j:i]). dp[k-1][j] + prefix[j] grows with
    j, so the best j sits where the two terms cross, found for all i by one searchsorted."""
    n = len(x)
    prefix = np.concatenate([[0], np.cumsum(x)]).astype(np.float64)
    dp = prefix.copy()  # one group: dp[1][i] = sum x[:i]
    choice = []
    for k in range(2, m + 1):
        i = np.arange(n + 1)
        # Only j >= k-1 can hold k-1 non-empty groups (dp is inf below, not monotone).
        j = np.searchsorted((dp + prefix)[k - 1 :], prefix, side="left") + (k - 1)
        j = np.clip(j, k - 1, np.maximum(i - 1, k - 1))
        jm = np.clip(j - 1, k - 1, None)
        v1 = np.maximum(dp[j], prefix - prefix[j])
        v2 = np.maximum(dp[jm], prefix - prefix[jm])
        pick = np.where(v2 < v1, jm, j)
        new = np.minimum(v1, v2)
        new[:k] = np.inf  # fewer items than groups
        choice.append(pick)
        dp = new
    cuts = [n]
    for pick in reversed(choice):
        cuts.append(int(pick[cuts[-1]]))
    cuts.append(0)
    return cuts[::-1]


def _spread(idx: np.ndarray, sizes, costs, cap, dp_size):
    """One step's pieces over dp_size bins: costliest first to the cheapest bin with room;
    token FFD if that fails; None if even that needs more than dp_size bins."""
    load, room = np.zeros(dp_size), np.full(dp_size, cap, dtype=np.int64)
    bins: list[list[int]] = [[] for _ in range(dp_size)]
    for i in idx[np.lexsort((idx, -sizes[idx], -costs[idx]))].tolist():
        ok = room >= sizes[i]
        if not ok.any():
            packed = _ffd_bins(sizes[idx], cap)
            if len(packed) > dp_size:
                return None
            return [[int(idx[p]) for p in b] for b in packed] + [[] for _ in range(dp_size - len(packed))]
        r = int(np.argmin(np.where(ok, load, np.inf)))
        bins[r].append(i)
        load[r] += costs[i]
        room[r] -= sizes[i]
    return bins


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
