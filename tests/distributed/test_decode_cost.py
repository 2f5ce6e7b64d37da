"""What a decode step of `sp_generate` costs a GPU, counted on CPU (`benchmarks/decode_cost.py`,
`benchmarks/_counting.py`): per attention layer no host sync, no host<->device copy and exactly one
collective (the all-gather of the ranks' split-KV partials; none on one process); per step outside
the layers one host read (the stop decision: every row's token to the host), one device->host copy
and, on an SP group, one collective (the tokens' all-gather). On one process, U2 and R2 (2 gloo
ranks) and U2 x R2 (4). Counted at 1 and 2 layers and 3 and 4 new tokens (the benchmark: 2 and 4
layers, 4 and 6 tokens; on one process both give the same counts, kernels included: 76 per layer,
32 per step)."""

from __future__ import annotations

import pytest

from tests.helpers.pool import worker_mesh

SIZES = dict(layers=(1, 2), new=(3, 4))  # the fewest layers and decode steps that separate the two


def _costs(ulysses: int, ring: int) -> tuple[dict, dict]:
    from benchmarks.decode_cost import sp_counts, split

    mesh = worker_mesh(ulysses, ring)
    return split(lambda layers, new: sp_counts(mesh, layers, new), **SIZES)


def _check(layer: dict, step: dict, sp: int) -> None:
    assert (layer["syncs"], layer["h2d"], layer["d2h"]) == (0, 0, 0), layer
    assert layer["collectives"] == (1 if sp > 1 else 0), layer
    assert (step["syncs"], step["d2h"], step["h2d"]) == (1, 1, 0), step
    assert step["collectives"] == (1 if sp > 1 else 0), step


def test_one_process():
    from benchmarks.decode_cost import sp_counts, split
    from hf_longctx.distributed.mesh import init_sequence_parallel

    mesh = init_sequence_parallel(1, 1)
    _check(*split(lambda layers, new: sp_counts(mesh, layers, new), **SIZES), sp=1)


@pytest.mark.parametrize("ulysses,ring,world", [(2, 1, 2), (1, 2, 2), (2, 2, 4)])
def test_sp_groups(pools, ulysses, ring, world):
    for layer, step in pools.get(world).run(_costs, ulysses, ring, timeout=300):
        _check(layer, step, sp=ulysses * ring)
