"""Published comparison strategies for the micro-batch planner, and the bin steps they
share with the default one.

Where it sits: called only by `data/packing.py` (`plan_microbatches(strategy=...)`), after
documents have become pieces with padded sizes and costs. Pure NumPy, deterministic (the
Hydraulis dispatch is seeded): the same plan on every rank (invariant 8).
`"ffd"`: token first-fit-decreasing (Megatron/NeMo packing), bins dealt round-robin;
`"karmarkar_karp"`: multi-way differencing on cost, then token-FFD per rank; `"hydraulis"`:
randomised greedy dispatch by time, then packing under the cap; `"flexsp"`: sort, cut
into consecutive steps by a DP minimising the largest token sum. `"balanced"` reuses the
shared bin steps here, so imports run packing.py -> packing_baselines.py, never back."""

from __future__ import annotations

import heapq
import math

import numpy as np


# --------------------------------------------------------------------------- shared steps
# Bins are lists of piece indices; `sizes` are padded token counts, `costs` T(size).
# `desc_order`, `ffd_bins`, `fill_empty` and `to_ranks` serve packing.py's default too.


def desc_order(sizes: np.ndarray, costs: np.ndarray) -> np.ndarray:
    """Pieces by cost, then size, descending; ties by index so every rank agrees."""
    return np.lexsort((np.arange(len(sizes)), -sizes, -costs))


def ffd_bins(sizes: np.ndarray, cap: int) -> list[list[int]]:
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


def fill_empty(bins: list[list[int]], costs: np.ndarray) -> list[list[int]]:
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


def to_ranks(slots: list[list[list[int]]], costs: np.ndarray, dp_size: int) -> list[list[list[int]]]:
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
    packed = [[[int(idx[i]) for i in b] for b in ffd_bins(sizes[idx], cap)]
              for idx in (np.asarray(p, dtype=np.int64) for p in per_rank)]
    m = max((len(b) for b in packed), default=0)
    flat = fill_empty([b for bins in packed for b in bins + [[] for _ in range(m - len(bins))]], costs)
    out = []
    for r in range(len(per_rank)):
        bins = flat[r * m : (r + 1) * m]
        load = np.array([costs[b].sum() if b else 0.0 for b in bins])
        out.append([sorted(bins[k]) for k in np.lexsort((np.arange(m), -load)).tolist()])
    return out


# --------------------------------------------------------------------------- strategies


def ffd(sizes, costs, cap, dp_size, seed):
    """Megatron/NeMo-style: token FFD bins, dealt to ranks round-robin in bin order."""
    bins = ffd_bins(sizes, cap)
    m = math.ceil(len(bins) / dp_size)
    bins = fill_empty(bins + [[] for _ in range(m * dp_size - len(bins))], costs)
    return [[sorted(bins[j * dp_size + r]) for j in range(m)] for r in range(dp_size)]


def karmarkar_karp(sizes, costs, cap, dp_size, seed):
    """Multi-way largest differencing on cost across ranks (no token cap), then each
    rank's pieces token-FFD packed into micro-batches."""
    # A partial partition is dp_size subsets kept sorted by cost, descending; subsets are
    # nested tuples so that merging is O(1) and flattening happens once at the end.
    heap = []
    for i in desc_order(sizes, costs).tolist():
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


def hydraulis(sizes, costs, cap, dp_size, seed, trials=8, jitter=0.05):
    """Randomised greedy dispatch (Hydraulis stage 1): pieces in a jittered costliest-first
    order, each to the least-loaded rank whose token budget (what token FFD would give it)
    still has room, best of `trials` seeded orders by max rank cost; then stage 2 packs
    each rank's micro-batches under the token cap."""
    budget = math.ceil(len(ffd_bins(sizes, cap)) / dp_size) * cap
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


def flexsp(sizes, costs, cap, dp_size, seed):
    """FlexSP appendix: sort by length, cut into m consecutive micro-batch steps by the
    dynamic programme minimising the largest token sum, then spread each step over the
    ranks (costliest piece to the cheapest rank with room); m grows until every step
    packs into dp_size bins."""
    order = np.lexsort((np.arange(len(sizes)), -sizes))
    m = math.ceil(len(ffd_bins(sizes, cap)) / dp_size)
    while True:
        cuts = min_max_cuts(sizes[order], min(m, len(order)))
        slots = []
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            slot = _spread(order[lo:hi], sizes, costs, cap, dp_size)
            if slot is None:
                break
            slots.append(slot)
        else:
            slots += [[[] for _ in range(dp_size)] for _ in range(m - len(slots))]
            flat = fill_empty([b for slot in slots for b in slot], costs)
            slots = [flat[j * dp_size : (j + 1) * dp_size] for j in range(m)]
            return to_ranks(slots, costs, dp_size)
        m += 1


def min_max_cuts(x: np.ndarray, m: int) -> list[int]:
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
            packed = ffd_bins(sizes[idx], cap)
            if len(packed) > dp_size:
                return None
            return [[int(idx[p]) for p in b] for b in packed] + [[] for _ in range(dp_size - len(packed))]
        r = int(np.argmin(np.where(ok, load, np.inf)))
        bins[r].append(i)
        load[r] += costs[i]
        room[r] -= sizes[i]
    return bins
