"""The per-size cost model the flexible-planner tests plan with.

`_cost(shapes, comm, overhead)`: a `GroupCost` that splits BASE (a linear-plus-quadratic
`CostModel`) over each group size, adds `comm` per token for groups larger than one and
`overhead` per micro-batch. Used by tests/unit/test_flex_packing.py and test_flex_unequal.py.
"""

from __future__ import annotations

from hf_longctx.data.cost import CostModel, GroupCost

BASE = CostModel(a=1.0, b=4096.0)


def _cost(shapes, comm=64.0, overhead=0.0):
    """BASE split over each size plus `comm` per token for groups > 1, `overhead` per micro-batch."""
    c = GroupCost.analytic(BASE, [s.size for s in shapes], comm_per_token={s.size: comm * (s.size > 1) for s in shapes})
    return GroupCost(c.models, tuple((s.size, overhead) for s in shapes))
