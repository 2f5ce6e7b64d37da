"""Flexible planner with unequal micro-batch counts: each rank runs as many micro-batches as
its share of the step needs, and no slot waits for its slowest group.

Where it sits: beside `flex/packing.plan_flexible` (same inputs, a `FlexPlan` with
`equal_calls=False`), before `flex/step.py`. Pure NumPy, the same on every rank. Usable
only where parameters stay unsharded for the step (`flex/unsharded_step.py`): FSDP2's
per-layer collectives are what force equal call counts.
Papers: Hydraulis §5 (heterogeneous propagation), FlexSP §4's per-sequence group choice;
list scheduling (Graham's LPT) on the ranks' timelines, with backfilling and closing
micro-batches (steps: docs/DESIGN.md "Planning a step"). Deterministic."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from hf_longctx.data.cost import GroupCost
from hf_longctx.sp_groups import GroupShape
from hf_longctx.flex.packing import prepare
from hf_longctx.flex.plan import FlexGroup, FlexPlan
from hf_longctx.data.pieces import check_int

PROMOTE_FACTORS = (1.0, 0.5, math.inf)  # τ tried, × the ideal per-rank load (inf: no promotion)


class _Timeline:
    """The micro-batches built so far and every rank's free time (steps 2-4 of the docstring).
    Micro-batch t: shape index `shape[t]`, aligned group `index[t]`, start/end times, padded
    tokens, documents; at most one per document plus one closing one per rank."""

    def __init__(self, world: int, sizes: list[int], caps: np.ndarray, ovh: np.ndarray, n_docs: int) -> None:
        self.sizes, self.caps, self.ovh = sizes, caps, ovh
        self.free = np.zeros(world)  # [world] time each rank is next free
        self.last = np.full(world, -1, dtype=np.int64)  # [world] its last micro-batch (-1: none)
        room = n_docs + world
        self.shape = np.zeros(room, dtype=np.int64)  # [T]
        self.index = np.zeros(room, dtype=np.int64)  # [T]
        self.tok = np.zeros(room, dtype=np.int64)  # [T]
        self.start = np.zeros(room)  # [T]
        self.docs: list[list[int]] = []
        # Idle stretches a wider micro-batch left on groups of the smallest size (its members
        # were free at different times): [group, from, to, micro-batch running there or -1].
        self.gaps: list[list] = []

    def place(self, d: int, k: int, cost: float, tokens: int) -> None:
        """Document d (shape k, its time and padded tokens) where it ends earliest: the open
        last micro-batch of an aligned group of shape k (still last on all its members, with
        room), or a new micro-batch on the aligned group free first."""
        s = self.sizes[k]
        free = self.free.reshape(-1, s).max(axis=1)  # [world/s] when each aligned group is free
        last = self.last.reshape(-1, s)  # [world/s, s]
        t = last[:, 0]  # [world/s]
        safe = np.maximum(t, 0)
        open_ = (
            (t >= 0) & (last == t[:, None]).all(axis=1) & (self.shape[safe] == k)
            & (self.index[safe] == np.arange(len(t))) & (self.tok[safe] + tokens <= self.caps[k])
        )  # [world/s] an open micro-batch of exactly this group that takes d
        ends = free + cost + np.where(open_, 0.0, self.ovh[k])  # [world/s]
        i = int(np.argmin(ends))  # ties: the lowest index
        if k == 0 and self._backfill(d, cost, tokens, float(ends[i])):
            return
        if open_[i]:
            t = int(last[i, 0])
        else:
            t = len(self.docs)
            self.shape[t], self.index[t], self.start[t] = k, i, free[i]
            self.docs.append([])
            s0 = self.sizes[0]
            for j in range(i * s // s0, (i + 1) * s // s0):  # members free before the start idle until it
                idle = float(self.free[j * s0 : (j + 1) * s0].max())
                if idle < free[i]:
                    self.gaps.append([j, idle, float(free[i]), -1])
        self.tok[t] += tokens
        self.docs[t].append(d)
        self.free[i * s : (i + 1) * s] = ends[i]
        self.last[i * s : (i + 1) * s] = t

    def _backfill(self, d: int, cost: float, tokens: int, end: float) -> bool:
        """Put document d into a gap if it ends there before `end` (a micro-batch of the
        smallest size has no collective, so it may run whenever its ranks idle)."""
        best, choice = end, None
        for g in self.gaps:
            j, at, until, t = g
            extend = t >= 0 and self.tok[t] + tokens <= self.caps[0]
            finish = at + cost + (0.0 if extend else float(self.ovh[0]))
            if finish <= until and finish < best:
                best, choice = finish, (g, extend)
        if choice is None:
            return False
        g, extend = choice
        if not extend:
            t = len(self.docs)
            self.shape[t], self.index[t], self.start[t] = 0, g[0], g[1]
            self.docs.append([])
            g[3] = t
        self.tok[g[3]] += tokens
        self.docs[g[3]].append(d)
        g[1] = best
        return True

    def close(self) -> None:
        """An empty micro-batch of the smallest size for every rank whose last micro-batch is
        not the last of all its members (or which has none)."""
        s0 = self.sizes[0]
        for i in range(len(self.free) // s0):
            r = slice(i * s0, (i + 1) * s0)
            t = int(self.last[i * s0])
            if t >= 0:
                s, j = self.sizes[self.shape[t]], int(self.index[t])
                if (self.last[j * s : (j + 1) * s] == t).all():
                    continue
            t = len(self.docs)
            self.shape[t], self.index[t], self.start[t] = 0, i, self.free[r].max()
            self.docs.append([])
            self.free[r] = self.start[t] + self.ovh[0]
            self.last[r] = t

    def slots(self) -> tuple[tuple[FlexGroup, ...], ...]:
        """Micro-batches by start time (ties: creation order, which each rank's own order
        follows), runs of pairwise disjoint ones merged into one slot."""
        order = sorted(range(len(self.docs)), key=lambda t: (float(self.start[t]), t))
        slots, current, used = [], [], set()
        for t in order:
            s, i = self.sizes[self.shape[t]], int(self.index[t])
            ranks = set(range(i * s, (i + 1) * s))
            if used & ranks:
                slots.append(tuple(current))
                current, used = [], set()
            current.append(FlexGroup(size=s, index=i, docs=tuple(self.docs[t])))
            used |= ranks
        if current:
            slots.append(tuple(current))
        return tuple(slots)


def plan_unequal(
    lengths: Sequence[int] | np.ndarray,
    *,
    shapes: Sequence[GroupShape],
    world_size: int,
    max_tokens_per_rank: int,
    cost: GroupCost,
    promote_factors: Sequence[float] = PROMOTE_FACTORS,
) -> FlexPlan:
    """Plan one step with unequal micro-batch counts per rank (`FlexPlan.equal_calls` False).

    Only for a step run with parameters unsharded throughout (`run_flex_step` and the
    Trainer check the model).

    Args:
        lengths: The step's document lengths (the same list on every rank).
        shapes: The group shapes a document may use (`bank.shapes` / `group_shapes(...)`).
        world_size: The ranks the groups tile.
        max_tokens_per_rank: Tokens one rank holds in one micro-batch (a group of size s
            packs at most s times this, padding included).
        cost: Each group size's time per document (`GroupCost`).
        promote_factors: The per-document loads tried, as multiples of the ideal per-rank
            load: a document costlier than that moves to a larger group (inf: none moves);
            the best plan is kept.

    Returns:
        The step's plan, with `equal_calls` False.

    Raises:
        ValueError: A document longer than the largest group holds (named), or an
            argument out of range.
    """
    world = check_int("world_size", world_size, 1)
    cap = check_int("max_tokens_per_rank", max_tokens_per_rank, 1)
    shapes, lengths, padded, caps, costs, smallest = prepare(lengths, shapes, world, cap, cost)
    n = len(lengths)
    sizes = [s.size for s in shapes]
    ovh = np.array([cost.overhead(s) for s in sizes], dtype=np.float64)  # [K] per micro-batch
    work = np.array([sizes[k] for k in smallest]) * costs[smallest, np.arange(n)] if n else np.zeros(0)  # [N] rank-time
    share = float(work.sum()) / world
    best, tried = None, set()
    for f in promote_factors:
        width = smallest.copy()
        if math.isfinite(f):
            for d in range(n):
                while width[d] + 1 < len(shapes) and costs[width[d], d] > f * share:
                    width[d] += 1
        key = tuple(width.tolist())
        if key in tried:
            continue
        tried.add(key)
        own = costs[width, np.arange(n)] if n else np.zeros(0)  # [N] each document's time on its group
        order = np.lexsort((np.arange(n), -lengths, -own, width == 0)).tolist()  # wide first, costliest first
        line = _Timeline(world, sizes, caps, ovh, n)
        for d in order:
            k = int(width[d])
            line.place(d, k, float(costs[k, d]), int(padded[k, d]))
        line.close()
        makespan = float(line.free.max())
        if best is None or makespan < best[0] - 1e-12 * max(makespan, 1.0):
            best = (makespan, line)
    return FlexPlan(
        slots=best[1].slots(), lengths=tuple(int(x) for x in lengths), world_size=world, max_tokens_per_rank=cap,
        shapes=shapes, strategy="unequal", equal_calls=False,
    )
