"""The flexible planner (flex/packing.py), group shapes and per-size costs: properties
checked with hypothesis, plus the refusals and the fixed-degree wrapper."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_longctx.data.cost import CostModel, GroupCost
from hf_longctx.sp_groups import group_shapes, ulysses_split
from hf_longctx.flex.packing import plan_fixed, plan_flexible
from hf_longctx.flex.plan import FlexGroup, FlexPlan
from tests.helpers.flex_costs import _cost


def _check_properties(plan: FlexPlan, lengths, world, cap):
    # every document exactly once
    docs = sorted(d for slot in plan.slots for g in slot for d in g.docs)
    assert docs == list(range(len(lengths)))
    for slot in plan.slots:
        covered = []
        for g in slot:
            assert g.index >= 0 and g.index * g.size + g.size <= world  # inside (aligned by construction)
            covered += list(g.ranks)
            shape = plan.shape(g.size)
            assert sum(shape.padded(lengths[d]) for d in g.docs) <= shape.capacity(cap)  # memory cap
        assert sorted(covered) == list(range(world))  # disjoint and tiling: equal call counts
    for r in range(world):
        assert len(plan.for_rank(r)) == plan.num_slots


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 600), min_size=0, max_size=60),
    world_exp=st.integers(0, 3),
    min_exp=st.integers(0, 1),
    slots=st.one_of(st.none(), st.integers(1, 4)),
    heads=st.sampled_from([2, 4, 8]),
    node=st.sampled_from([1, 2, 8]),
)
def test_planner_properties(lengths, world_exp, min_exp, slots, heads, node):
    world = 2**world_exp
    min_size = min(2**min_exp, world)
    cap = 128
    shapes = group_shapes(world, heads=heads, min_size=min_size, ranks_per_node=node, fpdt_chunks=2)
    too_long = [n for n in lengths if shapes[-1].padded(n) > shapes[-1].capacity(cap)]
    cost = _cost(shapes)
    kw = dict(shapes=shapes, world_size=world, max_tokens_per_rank=cap, cost=cost, num_slots=slots)
    if too_long:
        with pytest.raises(ValueError, match="do not fit the largest group"):
            plan_flexible(lengths, **kw)
        return
    plan = plan_flexible(lengths, **kw)
    _check_properties(plan, lengths, world, cap)
    again = plan_flexible(list(lengths), **kw)  # deterministic: same plan from the same list
    assert again == plan and again.fingerprint() == plan.fingerprint()
    if slots is not None:
        assert plan.num_slots >= slots
    s = plan.stats(cost)
    assert s["synced_over_ideal"] >= 1.0 - 1e-9  # the ideal is a floor of every plan


def test_long_documents_get_large_groups_and_short_ones_small():
    shapes = group_shapes(8, heads=8, ranks_per_node=8)
    cost = _cost(shapes)
    lengths = [900, 300] + [40] * 60
    plan = plan_flexible(lengths, shapes=shapes, world_size=8, max_tokens_per_rank=128, cost=cost, num_slots=4)
    size_of = {d: g.size for slot in plan.slots for g in slot for d in g.docs}
    assert size_of[0] == 8 and size_of[1] >= 4  # 900 tokens need 8 × 128; 300 need >= 4 × 128 (3 × 128 < 300)
    assert min(size_of.values()) == 1  # short documents run without SP
    assert len({tuple(l) for l in plan.layouts()}) > 1  # the layout changes from slot to slot


def test_flexible_beats_fixed_on_a_skewed_step():
    shapes = group_shapes(8, heads=8, ranks_per_node=8)
    cost = _cost(shapes)
    rng = np.random.default_rng(0)
    lengths = [512, 500, 450] + rng.integers(8, 90, 120).tolist()
    kw = dict(shapes=shapes, world_size=8, max_tokens_per_rank=128, cost=cost)
    flex = plan_flexible(lengths, **kw).stats(cost)["synced_step"]
    fixed = min(plan_fixed(lengths, shape=s, **kw).stats(cost)["synced_step"] for s in shapes if s.size >= 4)
    assert flex < fixed


def test_invalid_plans_are_refused_before_any_collective():
    shapes = group_shapes(4, heads=4)
    kw = dict(lengths=(5, 6), world_size=4, max_tokens_per_rank=8, shapes=shapes)
    with pytest.raises(ValueError, match="do not cover every rank exactly once"):  # ranks 2-3 would skip a call
        FlexPlan(slots=((FlexGroup(2, 0, (0, 1)),),), **kw)
    with pytest.raises(ValueError, match="do not cover every rank exactly once"):  # overlapping groups
        FlexPlan(slots=((FlexGroup(2, 0, (0,)), FlexGroup(1, 1, (1,)), FlexGroup(2, 1, ())),), **kw)
    with pytest.raises(ValueError, match="appear"):
        FlexPlan(slots=((FlexGroup(4, 0, (0,)),),), **kw)
    with pytest.raises(ValueError, match="capacity"):
        FlexPlan(slots=((FlexGroup(1, 0, (0, 1)), FlexGroup(1, 1, ()), FlexGroup(2, 1, ())),), **kw)
    with pytest.raises(ValueError, match="outside the world"):
        FlexPlan(slots=((FlexGroup(4, 1, (0, 1)),),), **kw)


def test_fixed_baselines_are_flex_plans():
    shapes = group_shapes(4, heads=4)
    cost = _cost(shapes)
    lengths = [30, 7, 12, 9, 25, 3, 14]
    for strategy in ("balanced", "flexsp", "hydraulis"):
        plan = plan_fixed(lengths, shape=shapes[1], shapes=shapes, world_size=4, max_tokens_per_rank=32, cost=cost,
                          strategy=strategy)
        assert all(l == (2, 2) for l in plan.layouts())
        _check_properties(plan, lengths, 4, 32)


def test_group_shapes_split_and_errors():
    assert ulysses_split(8, heads=32, ranks_per_node=8) == (8, 1)
    assert ulysses_split(64, heads=32, ranks_per_node=8) == (8, 8)  # Ulysses within a node, ring across
    assert ulysses_split(8, heads=12, ranks_per_node=8) == (4, 2)  # the largest power of two dividing 12
    shapes = group_shapes(8, heads=4, ranks_per_node=8, fpdt_chunks=2)
    assert [(s.size, s.ulysses, s.ring, s.fpdt_chunks) for s in shapes] == [
        (1, 1, 1, 1), (2, 2, 1, 2), (4, 4, 1, 2), (8, 4, 2, 1)]  # FPDT only where ring is 1
    assert shapes[3].doc_multiple == 4 and shapes[3].capacity(10) == 80
    with pytest.raises(ValueError, match="does not divide world size 6"):
        group_shapes(6, heads=4, max_size=4)
    with pytest.raises(ValueError, match="power of two"):
        group_shapes(8, heads=4, min_size=3)


def test_group_cost_fit_recovers_per_size_coefficients():
    truth = {1: CostModel(a=2e-9, b=1e-5, c=1e-3), 2: CostModel(a=1e-9, b=6e-6, c=2e-3)}
    sizes, lengths, times = [], [], []
    for s, m in truth.items():
        for n in (128, 512, 1024, 4096, 8192):
            sizes.append(s), lengths.append(n), times.append(m(n))
    # Packed micro-batches: the constant is paid once per micro-batch, not per document.
    for s, m in truth.items():
        for docs in ([100, 300], [50, 60, 70, 80]):
            sizes.append(s), lengths.append(docs), times.append(m.a * sum(n * n for n in docs) + m.b * sum(docs) + m.c)
    fit = GroupCost.fit(sizes, lengths, times)
    for s, m in truth.items():
        assert fit.overhead(s) == pytest.approx(m.c, rel=1e-6) and fit[s].c == pytest.approx(0.0, abs=1e-12 * m.c)
        for n in (256, 2048, 16384):
            assert fit.microbatch(s, [n]) == pytest.approx(m(n), rel=1e-6)
        assert fit.microbatch(s, [256, 512]) == pytest.approx(m(256) + m(512) - m.c, rel=1e-6)
    with pytest.raises(ValueError, match="group size 4"):
        GroupCost.fit([4, 4], [10, 20], [1.0, 2.0])


def test_group_cost_fit_separates_per_document_and_per_microbatch_constants():
    """Rows that pack different numbers of documents tell a per-document cost d_s (e.g. a
    varlen kernel walking the documents) from the per-micro-batch c_s; single-document rows
    alone cannot, and leave d_s = 0."""
    a, b, d, c = 1e-9, 5e-6, 4e-4, 2e-3
    sizes, lengths, times = [], [], []
    for docs in ([4096], [1024], [256, 256], [100, 200, 300], [64] * 12, [500] * 6, [2048, 1024, 512, 50]):
        sizes.append(4), lengths.append(docs)
        times.append(a * sum(x * x for x in docs) + b * sum(docs) + d * len(docs) + c)
    fit = GroupCost.fit(sizes, lengths, times)
    assert fit[4].c == pytest.approx(d, rel=1e-6) and fit.overhead(4) == pytest.approx(c, rel=1e-6)
    assert fit.microbatch(4, [32] * 20) == pytest.approx(a * 20 * 32 * 32 + b * 640 + 20 * d + c, rel=1e-6)
    single = GroupCost.fit([4] * 3, [[1024], [2048], [4096]], [a * n * n + b * n + d + c for n in (1024, 2048, 4096)])
    assert single[4].c == 0.0 and single.overhead(4) == pytest.approx(c + d, rel=1e-6)


def test_sizes_as_ints_num_slots_and_one_ranks_per_node_default(monkeypatch):
    """Group sizes (ints) work where GroupShapes are wanted: `plan_fixed(shape=2, shapes=...)`
    equals `shape=shapes[1]`, `GroupCost.from_config(config, [1, 2, 4])` equals it built from
    `group_shapes(...)`; `plan_fixed(num_slots=...)` pads with empty groups (fewer than needed
    is refused); `group_shapes` and `init_group_bank` share one `ranks_per_node` default."""
    from transformers import LlamaConfig

    from hf_longctx import sp_groups as flex_groups

    shapes = group_shapes(4, heads=4)
    cost = _cost(shapes)
    lengths = [30, 7, 12, 9, 25, 3, 14]
    kw = dict(shapes=shapes, world_size=4, max_tokens_per_rank=16, cost=cost)
    assert plan_fixed(lengths, shape=2, **kw) == plan_fixed(lengths, shape=shapes[1], **kw)
    with pytest.raises(ValueError, match="no group of that size"):
        plan_fixed(lengths, shape=8, **kw)
    base = plan_fixed(lengths, shape=2, **kw)
    padded = plan_fixed(lengths, shape=2, num_slots=len(base.slots) + 2, **kw)
    assert padded.slots[: len(base.slots)] == base.slots and len(padded.slots) == len(base.slots) + 2
    assert all(g.docs == () and g.size == 2 for slot in padded.slots[len(base.slots):] for g in slot)
    assert len(base.slots) >= 2
    with pytest.raises(ValueError, match="fewer than the"):
        plan_fixed(lengths, shape=2, num_slots=len(base.slots) - 1, **kw)

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256)
    by_shape = GroupCost.from_config(config, group_shapes(4, heads=4, ranks_per_node=2))
    by_size = GroupCost.from_config(config, [1, 2, 4], ranks_per_node=2)
    for s in (1, 2, 4):
        assert by_size[s](100) == by_shape[s](100)

    monkeypatch.setattr(flex_groups, "default_ranks_per_node", lambda world: 2)  # what both read
    assert [(s.ulysses, s.ring) for s in group_shapes(4, heads=4)] == [(1, 1), (2, 1), (2, 2)]
    import inspect

    from hf_longctx.flex.bank import init_group_bank

    assert inspect.signature(init_group_bank).parameters["ranks_per_node"].default is None
    assert inspect.signature(group_shapes).parameters["ranks_per_node"].default is None
