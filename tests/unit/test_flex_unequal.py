"""The unequal-count flexible planner (flex/unequal.py) and FlexPlan's rules for it:
properties checked with hypothesis, Graham's list-scheduling bound, the refusals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_longctx.sp_groups import group_shapes
from hf_longctx.flex.packing import plan_flexible
from hf_longctx.flex.plan import FlexGroup, FlexPlan
from hf_longctx.flex.unequal import plan_unequal
from tests.helpers.flex_costs import _cost



def _runs_without_deadlock(plan: FlexPlan) -> bool:
    """Execute the plan as blocking collectives would: each rank works through its groups in
    slot order; a group runs only when it is the next one of ALL its members."""
    queues = {r: [(m, g.size, g.index) for m, slot in enumerate(plan.slots) for g in slot if r in g.ranks]
              for r in range(plan.world_size)}
    progress = True
    while progress and any(queues.values()):
        progress = False
        heads = {r: q[0] for r, q in queues.items() if q}
        for r, task in heads.items():
            _, size, index = task
            members = range(index * size, (index + 1) * size)
            if all(queues[q] and queues[q][0] == task for q in members):
                for q in members:
                    queues[q].pop(0)
                progress = True
                break
    return not any(queues.values())


def _check(plan: FlexPlan, lengths, world, cap):
    assert not plan.equal_calls
    assert sorted(d for slot in plan.slots for g in slot for d in g.docs) == list(range(len(lengths)))  # once each
    last = {}
    for m, slot in enumerate(plan.slots):
        used = []
        for g in slot:
            assert g.index * g.size + g.size <= world  # aligned, inside the world
            used += list(g.ranks)
            shape = plan.shape(g.size)
            assert sum(shape.padded(lengths[d]) for d in g.docs) <= shape.capacity(cap)  # memory cap
            for r in g.ranks:
                last[r] = (m, g.size, g.index)
        assert len(used) == len(set(used))  # disjoint within a slot
    assert sorted(last) == list(range(world))  # every rank runs >= 1 micro-batch
    for r, (m, size, index) in last.items():  # closing: a rank's last is its members' last
        assert all(last[q] == (m, size, index) for q in range(index * size, (index + 1) * size))
    assert _runs_without_deadlock(plan)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 600), min_size=0, max_size=60),
    world_exp=st.integers(0, 3),
    min_exp=st.integers(0, 1),
    heads=st.sampled_from([2, 4, 8]),
    node=st.sampled_from([1, 2, 8]),
    overhead=st.sampled_from([0.0, 1e5]),
)
def test_planner_properties(lengths, world_exp, min_exp, heads, node, overhead):
    world = 2**world_exp
    cap = 128
    shapes = group_shapes(world, heads=heads, min_size=min(2**min_exp, world), ranks_per_node=node, fpdt_chunks=2)
    kw = dict(shapes=shapes, world_size=world, max_tokens_per_rank=cap, cost=_cost(shapes, overhead=overhead))
    if any(shapes[-1].padded(n) > shapes[-1].capacity(cap) for n in lengths):
        with pytest.raises(ValueError, match="do not fit the largest group"):
            plan_unequal(lengths, **kw)
        return
    plan = plan_unequal(lengths, **kw)
    _check(plan, lengths, world, cap)
    assert plan == plan_unequal(list(lengths), **kw)  # deterministic
    stats = plan.stats(kw["cost"])
    assert stats["synced_step"] >= stats["ideal_step"] * (1 - 1e-9)  # the ideal is a lower bound


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 128), min_size=1, max_size=80), world_exp=st.integers(1, 3))
def test_graham_bound_when_every_document_fits_one_rank(lengths, world_exp):
    """Documents that all fit one rank, no per-micro-batch overhead: the no-promotion
    candidate is list scheduling, so the makespan is at most the average load plus the
    costliest document (Graham 1966), whatever the caps split into micro-batches."""
    world = 2**world_exp
    shapes = group_shapes(world, heads=8, ranks_per_node=8)
    cost = _cost(shapes)
    plan = plan_unequal(lengths, shapes=shapes, world_size=world, max_tokens_per_rank=128, cost=cost)
    own = cost(1, np.asarray(lengths, dtype=np.float64))
    assert plan.stats(cost)["synced_step"] <= own.sum() / world + own.max() + 1e-6 * own.sum()


def test_skewed_step_beats_equal_counts():
    """One long document needs 4 of 8 ranks; 60 short ones: with equal counts its slot makes
    the other ranks' slots as long; with unequal counts they run more short micro-batches."""
    world, cap = 8, 256
    shapes = group_shapes(world, heads=8, ranks_per_node=8)
    cost = _cost(shapes)
    lengths = [900] + [40 + 7 * (i % 13) for i in range(60)]
    unequal = plan_unequal(lengths, shapes=shapes, world_size=world, max_tokens_per_rank=cap, cost=cost).stats(cost)
    equal = plan_flexible(lengths, shapes=shapes, world_size=world, max_tokens_per_rank=cap, cost=cost).stats(cost)
    assert unequal["calls"][0] < unequal["calls"][1]  # ranks really run different counts
    assert unequal["synced_step"] < equal["synced_step"]
    assert unequal["synced_over_ideal"] <= 1.05, unequal


def _plan(slots, world=4, equal_calls=False):
    shapes = group_shapes(world, heads=4, ranks_per_node=4)
    groups = tuple(tuple(FlexGroup(s, i, d) for s, i, d in slot) for slot in slots)
    n = 1 + max((d for slot in slots for _, _, docs in slot for d in docs), default=-1)
    return FlexPlan(slots=groups, lengths=(4,) * n, world_size=world, max_tokens_per_rank=64, shapes=shapes,
                    equal_calls=equal_calls)


def test_refusals():
    ok = [[(2, 0, (0,)), (2, 1, (1,))], [(1, 0, (2,)), (1, 1, ())]]
    _plan(ok)
    with pytest.raises(ValueError, match="do not cover every rank exactly once"):
        _plan(ok, equal_calls=True)  # the default mode refuses unequal counts
    with pytest.raises(ValueError, match=r"rank 2 ends the step in slot 0's group \(size 2, index 1\) but its members \[3\]"):
        _plan([[(2, 0, (0,)), (2, 1, (1,))], [(1, 0, (2,)), (1, 1, ()), (1, 3, (3,))]])
    with pytest.raises(ValueError, match=r"overlap on ranks \[1\]"):
        _plan([[(2, 0, (0,)), (1, 1, (1,)), (2, 1, (2,))]])
    with pytest.raises(ValueError, match=r"ranks \[3\] run no micro-batch"):
        _plan([[(2, 0, (0,)), (1, 2, (1,))]])
