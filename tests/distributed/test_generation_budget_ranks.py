"""The planner's rollout memory (`capacity/generation_budget.py`) against the census of `sp_generate`
on 4 gloo ranks: Ulysses 4 (the all-to-all's buffers, K/V replicated for H_kv < U) and U2 x R2 (the
ring's K/V in flight and fp32 accumulators), the worst rank within 5 % (measured +0.2 % to +0.5 %).
The one-process case: tests/unit/test_generation_budget.py."""

from __future__ import annotations

import pytest

from tests.helpers.pool import worker_mesh

TOKENS = 8192


def _measure(ulysses: int, ring: int, mode: str) -> dict:
    from benchmarks.generation_memory import measure

    return measure(worker_mesh(ulysses, ring), "T1", mode, TOKENS)


@pytest.mark.parametrize("ulysses,ring", [(4, 1), (2, 2)])
@pytest.mark.parametrize("mode", ["off", "max"])
def test_rollout_memory_on_four_ranks(pools, ulysses, ring, mode):
    from benchmarks.generation_memory import estimate

    worst = max(pools.get(4).run(_measure, ulysses, ring, mode, timeout=300), key=lambda r: r["device"])
    want = estimate("T1", mode, TOKENS, ulysses, ring)
    assert abs(want / worst["device"] - 1) <= 0.05, (want / worst["s_local"], worst["device"] / worst["s_local"])
