"""The default packing strategy, `"balanced"`: this library's own (the baselines are in
`packing_baselines.py`).

Where it sits: `packing.plan_microbatches(strategy="balanced")`. The step is a grid of
micro-batch slots × DP ranks; with FSDP every rank waits for the slowest at every slot, so
the step costs Σ over slots of the slot's costliest bin. `balanced` fills the grid by cost
under the token cap, then improves it by moves and swaps (see its docstring).
"""

from __future__ import annotations

import math

import numpy as np

from hf_longctx.data.packing_baselines import desc_order, ffd_bins, fill_empty, to_ranks

# --------------------------------------------------------------------------- default strategy
# Bins are lists of piece indices; `sizes` are padded token counts, `costs` T(size).
# Token FFD, empty-bin filling and dealing slots to ranks are shared with the baselines
# and live in packing_baselines.py.


def slots_by_cost(bins: list[list[int]], costs: np.ndarray, dp_size: int) -> list[list[list[int]]]:
    """Sort bins by cost and cut them into consecutive groups of dp_size: for a fixed set
    of bins this minimises Σ over slots of the slot's costliest bin."""
    load = np.array([costs[b].sum() if b else 0.0 for b in bins])
    first = np.array([min(b) if b else len(costs) for b in bins])
    order = np.lexsort((first, -load)).tolist()
    return [[bins[k] for k in order[m : m + dp_size]] for m in range(0, len(order), dp_size)]


def cost_fill(sizes, costs, cap, dp_size, m, order, max_slots):
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


def balanced(sizes, costs, cap, dp_size, seed):
    """The default. Think of the step as a grid: `m` micro-batch slots × dp_size ranks,
    each cell a bin of `cap` tokens; the step costs Σ over slots of the slot's costliest
    bin. So costly documents must share a slot with equally costly bins on the other
    ranks, and cheap ones must even out the rest.

    1. m = ⌈(bins token FFD needs) / dp_size⌉: no more micro-batches than memory needs.
    2. `cost_fill`: costliest piece first, each into the bin where it raises Σ of slot
       maxima least (judging bins by projected full cost), opening one extra slot only
       if some piece finds no room (the contract allows m + 1).
    3. Empty bins take the cheapest pieces of bins holding several.
    4. `improve`: moves and swaps that lower Σ of slot maxima.
    5. Bins sorted by cost and cut into slots of dp_size (optimal for fixed bins), then
       dealt to ranks to even out per-rank totals (`to_ranks`).
    `seed` is unused: the plan is deterministic without randomness.
    """
    base = math.ceil(len(ffd_bins(sizes, cap)) / dp_size)
    order = desc_order(sizes, costs)
    bins = cost_fill(sizes, costs, cap, dp_size, base, order, max_slots=base + 1)
    if bins is None:  # token FFD always fits `base` slots; balance it afterwards
        bins = ffd_bins(sizes, cap)
        bins += [[] for _ in range(base * dp_size - len(bins))]
    bins = fill_empty(bins, costs)
    if dp_size > 1:
        bins = improve(bins, sizes, costs, cap, dp_size)
    return to_ranks(slots_by_cost(bins, costs, dp_size), costs, dp_size)


def improve(bins, sizes, costs, cap, dp_size, max_changes=None, work=20_000_000):
    """Local search on Σ of slot maxima: relieve each slot's costliest bin by moving
    one of its pieces to another bin, or swapping it with a cheaper piece, wherever that
    lowers the sum (slots re-formed by cost after every change). A move never takes a bin's
    last piece, so no bin filled by `fill_empty` ends empty.

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
            # A move never empties a bin: an empty micro-batch only when pieces < bins.
            if len(xs) > 1 and delta[i, k] < best[0]:
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
