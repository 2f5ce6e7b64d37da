"""The USP attention cases: their table, the packed layout they run on, the fp32 tolerance.

CASES covers MHA, GQA with H_kv = H/2 and H_kv < U, MQA, non-causal, sliding windows,
softcap and B = 2 unpacked rows. `_case(mesh, case, dtype)` runs one of them through
`usp_attention` on this rank (`attention_cases.case_errors`: forward and dq/dk/dv against
the float64 reference) on packed documents from `_lengths` (uneven multiples of the mesh's
doc_multiple plus a padding document). FP32_TOL (relative, 2e-5) is justified in
tests/distributed/test_usp.py. Shared by test_usp.py, test_sinks.py and tests/gpu/.
"""

from __future__ import annotations

import torch

from hf_longctx.ops.usp import usp_attention
from tests.helpers.attention_cases import case_errors

FP32_TOL = 2e-5


def _lengths(mesh, seed: int, docs: int) -> list[int]:
    """Uneven document lengths (multiples of doc_multiple) plus the trailing padding document."""
    g = torch.Generator().manual_seed(seed)
    dm = mesh.doc_multiple
    lengths = [int(n) * dm for n in torch.randint(1, 9, (docs,), generator=g)]
    pad = (-sum(lengths)) % mesh.seq_multiple
    return lengths + ([pad] if pad else [])


def _case(mesh, case: dict, dtype: torch.dtype):
    """Packed documents (multiples of doc_multiple), or B = 2 rows of one document each."""
    if case.get("packed", True):
        lengths = _lengths(mesh, case.get("seed", 0) + 1000 * mesh.dp_rank, case.get("docs", 4))
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
    else:
        cu = None
    rows = (2, 8 * mesh.sp * max(mesh.doc_multiple, 2))
    return case_errors(mesh, case, dtype, attention=usp_attention, cu=cu, rows=rows, head_dim=16)


CASES = [
    dict(heads=8, kv_heads=8),
    dict(heads=8, kv_heads=4, docs=5, seed=1),
    dict(heads=8, kv_heads=1, seed=2),  # MQA: one KV head, replicated for U > 1
    dict(heads=8, kv_heads=2, seed=3),  # H_kv < U for U = 4
    dict(heads=4, kv_heads=2, causal=False, seed=4),
    dict(heads=4, kv_heads=2, window=5, seed=5),
    dict(heads=4, kv_heads=4, window=3, causal=False, seed=6),
    dict(heads=4, kv_heads=2, softcap=2.0, seed=7),
    dict(heads=4, kv_heads=4, packed=False, seed=8),  # B = 2 rows, one document each
]
