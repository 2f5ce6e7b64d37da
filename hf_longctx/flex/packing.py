"""Flexible planner: per micro-batch slot, a partition of the world into SP groups of
different sizes, and the documents of each group.

Where it sits: where `data/packing.py` sits for a fixed SP degree (FlexSP §4, Hydraulis
§4-5): after the step sampler, before `flex/step.py` shards each group's micro-batch. Pure
NumPy: every rank computes the same plan (invariant 8), compared by `FlexPlan.fingerprint()`.
A greedy construction with projected costs instead of FlexSP's MILP, so it runs in
milliseconds (steps: docs/DESIGN.md "Planning a step"; steps 2-3: `flex/placement.py`).
Guarantees: every slot covers every rank exactly once (equal forward/backward counts, as
FSDP2's per-layer collectives need); groups are aligned (a group of size s starts at a
multiple of s). `plan_fixed` gives the fixed-degree strategies as a FlexPlan."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from hf_longctx.data.cost import GroupCost
from hf_longctx.sp_groups import GroupShape
from hf_longctx.flex.plan import FlexGroup, FlexPlan
from hf_longctx.flex.placement import construct
from hf_longctx.data.packing import plan_microbatches
from hf_longctx.data.pieces import as_lengths, check_int

TAU_FACTORS = (0.75, 1.0, 1.5, math.inf)  # target slot lengths tried, × the ideal slot length (inf: no promotion)


def _tables(lengths, shapes, cap_per_rank, cost):
    """[K, N] padded tokens, per-rank cost and feasibility of every document in every shape."""
    padded = np.stack([s.padded(lengths) for s in shapes])  # [K, N]
    caps = np.array([s.capacity(cap_per_rank) for s in shapes], dtype=np.int64)  # [K]
    costs = np.stack([np.asarray(cost(s.size, padded[k]), dtype=np.float64) for k, s in enumerate(shapes)])  # [K, N]
    return padded, caps, costs, padded <= caps[:, None]


def prepare(lengths, shapes, world: int, cap: int, cost: GroupCost):
    """Checks shared by the flexible planners, then the tables: (shapes smallest first,
    lengths, [K, N] padded tokens, [K] capacities, [K, N] per-rank costs, [N] smallest
    shape index holding each document). Raises ValueError naming the offending values."""
    shapes = tuple(sorted(shapes, key=lambda s: s.size))
    if not shapes:
        raise ValueError("shapes is empty: pass the group bank's shapes")
    bad = [s.size for s in shapes if world % s.size]
    if bad:
        raise ValueError(f"group sizes {bad} do not divide world size {world}")
    missing = [s.size for s in shapes if s.size not in cost.sizes]
    if missing:
        raise ValueError(f"cost has no model for group sizes {missing} (it has {list(cost.sizes)})")
    lengths = as_lengths(lengths)
    sizes = [s.size for s in shapes]
    padded, caps, costs, ok = _tables(lengths, shapes, cap, cost)
    fits = ok.any(axis=0)
    if not fits.all():
        bad = np.flatnonzero(~fits)[:8]
        raise ValueError(
            f"{int((~fits).sum())} document(s) do not fit the largest group ({sizes[-1]} ranks × {cap} tokens = {caps[-1]}): "
            + ", ".join(f"document {i} has {lengths[i]} tokens" for i in bad)
            + "; raise max_size / max_tokens_per_rank or split them"
        )
    smallest = np.argmax(ok, axis=0) if len(lengths) else np.zeros(0, dtype=np.int64)  # [N] smallest feasible shape
    return shapes, lengths, padded, caps, costs, smallest


def _assemble(gs, gm, load, g_docs, sizes):
    """Groups → slots: largest first within a slot (aligned offsets), costliest slot first."""
    slots = []
    for m in range(int(gm.max()) + 1 if len(gm) else 0):
        members = sorted(np.flatnonzero(gm == m).tolist(), key=lambda g: (-sizes[gs[g]], -load[g], g))
        offset, groups = 0, []
        for g in members:
            s = sizes[gs[g]]
            groups.append(FlexGroup(size=s, index=offset // s, docs=tuple(g_docs[g])))
            offset += s
        slots.append((max(load[members]) if members else 0.0, m, tuple(groups)))
    return tuple(groups for _, _, groups in sorted(slots, key=lambda t: (-t[0], t[1])))


def plan_flexible(
    lengths: Sequence[int] | np.ndarray,
    *,
    shapes: Sequence[GroupShape],
    world_size: int,
    max_tokens_per_rank: int,
    cost: GroupCost,
    num_slots: int | None = None,
    tau_factors: Sequence[float] = TAU_FACTORS,
) -> FlexPlan:
    """Plan one step on groups of the given shapes (`bank.shapes` / `group_shapes(...)`).

    Args:
        lengths: The step's document lengths (the same list on every rank).
        shapes: The group shapes a document may use (`bank.shapes` / `group_shapes(...)`).
        world_size: The ranks the groups tile.
        max_tokens_per_rank: Tokens one rank holds in one micro-batch (a group of size s
            packs at most s times this, padding included).
        cost: Each group size's time per document (`GroupCost`).
        num_slots: Micro-batch slots to aim for (default, and at least: the fewest the
            tokens need at the smallest feasible sizes); the planner opens more only when
            documents do not fit.
        tau_factors: The target slot lengths tried, as multiples of the ideal one: a
            document costlier than the target moves to a larger group (inf: none moves);
            the best plan is kept.

    Returns:
        The step's plan, every rank one micro-batch per slot.

    Raises:
        ValueError: A document longer than the largest group holds (named), or an
            argument out of range.
    """
    world = check_int("world_size", world_size, 1)
    cap = check_int("max_tokens_per_rank", max_tokens_per_rank, 1)
    shapes, lengths, padded, caps, costs, smallest = prepare(lengths, shapes, world, cap, cost)
    n = len(lengths)
    sizes = [s.size for s in shapes]
    work = np.array([sizes[k] for k in smallest]) * costs[smallest, np.arange(n)] if n else np.zeros(0)
    need = int(np.ceil(padded[smallest, np.arange(n)].sum() / (world * cap))) if n else 1
    # Never aim below what the tokens need: slots opened one by one during the fill would
    # collect only the leftovers (unbalanced); the aim is met exactly whenever it suffices.
    m = max(1, need) if num_slots is None else max(check_int("num_slots", num_slots, 1), need)
    tau0 = float(work.sum()) / (world * m) if n else 0.0
    # Cheapest per-token cost of each shape (projects a group's free room as if filled).
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = np.array([float(np.min(costs[k] / np.maximum(padded[k], 1))) if n else 0.0 for k in range(len(shapes))])
    ovh = np.array([cost.overhead(s) for s in sizes], dtype=np.float64)  # [K] per micro-batch
    order = np.lexsort((np.arange(n), -lengths, -work)).tolist()  # costliest first, ties by index
    best, tried = None, set()
    for f in tau_factors:
        width = smallest.copy()
        if math.isfinite(f):
            tau = f * tau0
            for d in np.flatnonzero(costs[smallest, np.arange(n)] > tau).tolist():
                k = int(smallest[d])
                while k + 1 < len(shapes) and costs[k, d] > tau:
                    k += 1
                width[d] = k
        key = tuple(width.tolist())
        if key in tried:  # another target gave the same widths, hence the same plan
            continue
        tried.add(key)
        gs, gm, load, docs = construct(width.tolist(), order, padded, caps, costs, rho, sizes, world, m, ovh)
        step = sum(float(load[gm == j].max()) for j in range(int(gm.max()) + 1))
        if best is None or step < best[0] - 1e-12 * max(step, 1.0):
            best = (step, gs, gm, load, docs)
    _, gs, gm, load, docs = best
    return FlexPlan(
        slots=_assemble(gs, gm, load, docs, sizes), lengths=tuple(int(x) for x in lengths), world_size=world,
        max_tokens_per_rank=cap, shapes=shapes, strategy="flex",
    )


def plan_fixed(
    lengths: Sequence[int] | np.ndarray,
    *,
    shape: GroupShape | int,
    shapes: Sequence[GroupShape] | None = None,
    world_size: int,
    max_tokens_per_rank: int,
    cost: GroupCost,
    strategy: str = "balanced",
    seed: int = 0,
    num_slots: int | None = None,
) -> FlexPlan:
    """One fixed SP degree for the whole step, as a FlexPlan (every slot world/size groups of
    `shape`): the fixed-degree strategies of `packing.py` -- "balanced", "ffd",
    "karmarkar_karp", FlexSP's DP chunking "flexsp", Hydraulis's two-stage "hydraulis" --
    as baselines and for a step driver that only runs FlexPlans.

    Args:
        lengths: The step's document lengths (the same list on every rank).
        shape: The group shape, or a group size (int) whose split is the one in `shapes`.
        shapes: `bank.shapes`, where `shape` is an int.
        world_size: The ranks the groups tile.
        max_tokens_per_rank: Tokens one rank holds in one micro-batch.
        cost: Each group size's time per document (`GroupCost`).
        strategy: One of `plan_microbatches`' strategies.
        seed: Drives the randomised "hydraulis" dispatch only.
        num_slots: The step's micro-batch slots (as `plan_flexible`'s; the missing ones are
            empty groups).

    Returns:
        The step's plan, every slot world/size groups of `shape`.

    Raises:
        ValueError: Fewer `num_slots` than the documents need (both named), a size without
            a shape in `shapes`, or an argument out of range.
    """
    world = check_int("world_size", world_size, 1)
    if isinstance(shape, int) and not isinstance(shape, bool):
        match = [sh for sh in shapes or () if sh.size == shape]
        if not match:
            raise ValueError(
                f"shape={shape} is a group size, and shapes={None if shapes is None else [s.size for s in shapes]} has "
                "no group of that size to take its ulysses x ring split from: pass shapes=bank.shapes (or "
                "group_shapes(...)) including it, or a GroupShape"
            )
        shape = match[0]
    if world % shape.size:
        raise ValueError(f"group size {shape.size} does not divide world size {world}")
    dp = world // shape.size
    plan = plan_microbatches(
        lengths, dp_size=dp, max_tokens=shape.capacity(max_tokens_per_rank), cost=cost[shape.size], seed=seed,
        strategy=strategy, doc_multiple=shape.doc_multiple, seq_multiple=shape.seq_multiple,
    )
    slots = []
    for j in range(plan.num_microbatches):
        slots.append(tuple(
            FlexGroup(size=shape.size, index=r, docs=tuple(plan.pieces[p].doc for p in plan.ranks[r][j])) for r in range(dp)
        ))
    if num_slots is not None:
        want = check_int("num_slots", num_slots, 1)
        if want < len(slots):
            raise ValueError(f"num_slots={want} is fewer than the {len(slots)} micro-batch slots these documents need "
                             f"at group size {shape.size}; pass num_slots >= {len(slots)} or None")
        slots += [tuple(FlexGroup(size=shape.size, index=r, docs=()) for r in range(dp))] * (want - len(slots))
    return FlexPlan(
        slots=tuple(slots), lengths=tuple(int(x) for x in as_lengths(lengths)), world_size=world,
        max_tokens_per_rank=int(max_tokens_per_rank), shapes=tuple(shapes) if shapes else (shape,), strategy=strategy,
    )
