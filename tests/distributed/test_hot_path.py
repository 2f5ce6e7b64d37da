"""No host sync inside a decoder layer on the CUDA dispatch path (issue 19, item 2).

`benchmarks/hot_path.py` counts, with torch's function and dispatch modes, what would block
the host on CUDA (`.item()`, `nonzero`, blocking host->device copies, ...) while a patched
tiny model runs one fwd+bwd step with the local attention forced onto the packed flash-attn
backend (emulated kernel, `tests/emulated_backends.py`). Per layer = the difference between
a 4-layer and a 2-layer model, so per-step costs (sharding, loss, the consistency check) do
not count. Every layout of the benchmark must show 0 syncs per layer. What fails here: a
blocking `.to(device)` of host-built indices / cu_seqlens inside a layer (the packed
backend's block index did that with ring degree 2), an `.item()` or `.tolist()` per layer.
"""

from __future__ import annotations

import pytest

from benchmarks.hot_path import LAYOUTS, layout_costs
from tests.pool import worker_mesh


def _costs(label: str, ulysses: int, ring: int, chunks: int) -> dict:
    return layout_costs(label, worker_mesh(ulysses, ring, chunks))


@pytest.mark.parametrize("label,ulysses,ring,chunks", [row[:4] for row in LAYOUTS], ids=[row[0] for row in LAYOUTS])
def test_no_sync_per_layer(pools, label, ulysses, ring, chunks):
    for rank, c in enumerate(pools.get(ulysses * ring).run(_costs, label, ulysses, ring, chunks)):
        assert c["syncs"] == 0, f"{label}, rank {rank}: {c['syncs']} syncs per layer at {c['sync_sites']}"
        assert c["kernels"] > 0 and c["collectives"] > 0  # the counter sees the layer's work
