"""Ring and FPDT make no widened copy of a block or gradient beyond the float32 sums they need.

`benchmarks/attention_copies.py` counts, per attention call on the packed (GPU) backend with
bf16 inputs, the bf16 -> float32 copies of at least half a K/V block, the float32 zero fills
and the row gathers/scatters. Every sum that has more than one piece starts from ONE widened
copy of its first piece (the accumulator) and takes the others in place (mixed-dtype adds,
`lse.merge_` into views); a sum with one piece stays the kernel's own result. So, for one
document (zigzag halves and FPDT chunks are contiguous rows: views, no index):
- ring R = 2: forward 1 (the output accumulator), backward 3 (dq, and the travelling
  float32 dK/dV buffer's two halves);
- FPDT with u causal chunks: forward u - 1 (each query chunk after the first merges),
  backward 3·(u - 1) (dq of chunks 1..u-1, dK and dV of chunks 0..u-2).
Inserting one `.to(float32)` of a kernel gradient makes these counts fail (checked once).
"""

from __future__ import annotations

import pytest

from benchmarks.attention_copies import LAYOUTS, attention_ops
from tests.helpers.pool import worker_mesh


def _ops(label: str) -> dict:
    _, ulysses, ring, chunks, _ = next(row for row in LAYOUTS if row[0] == label)
    return attention_ops(label, worker_mesh(ulysses, ring, chunks))


EXACT = {  # label -> (forward widened copies, backward widened copies); no zero fill, no index op
    "ring R=2, one document": (1, 3),
    "FPDT u=2 (U2), one document": (1, 3),
    "FPDT u=4 (U2), one document": (3, 9),
}


@pytest.mark.parametrize("label", list(EXACT))
def test_one_document_widens_only_the_accumulators(pools, label):
    fwd, bwd = EXACT[label]
    for rank, r in enumerate(pools.get(2).run(_ops, label)):
        assert r["forward"].get("widen", 0) == fwd and r["backward"].get("widen", 0) == bwd, (label, rank, r)
        for phase in ("forward", "backward"):
            assert r[phase].get("zero fill", 0) == 0 and r[phase].get("index", 0) == 0, (label, rank, phase, r)


def test_packed_documents_add_in_place(pools):
    """Scattered rows (one range per document) take an index, but still no zero-filled sum in the
    ring, and on top of the accumulators at most one widened copy per scattered gradient of the
    one call of step 1 (index_add_ needs its source in the sum's dtype): dq, or dK and dV."""
    for rank, r in enumerate(pools.get(2).run(_ops, "ring R=2, 4 packed documents")):
        assert r["forward"].get("widen", 0) == 1 and r["backward"].get("widen", 0) <= 3 + 2, (rank, r)
        assert r["forward"].get("zero fill", 0) == r["backward"].get("zero fill", 0) == 0, (rank, r)
