"""The FPDT attention cases: their table, the packed layout they run on, the fp32 tolerance.

CASES mirrors the USP table (MHA, GQA, MQA, H_kv < U, non-causal, windows that skip early
K/V chunks, softcap, B = 2 unpacked rows). `_case(mesh, case, dtype)` runs one of them
through `fpdt_attention` with K/V offload off and on (error names of the second prefixed
"off_") via `attention_cases.case_errors`, on documents from `_boundaries` (up to one
seq_multiple long each, so they straddle chunks, plus padding). FP32_TOL (relative, 2e-5)
is justified in tests/distributed/test_fpdt.py. Shared by test_fpdt.py, test_sinks.py and
tests/gpu/.
"""

from __future__ import annotations

import torch

from hf_longctx.ops.fpdt import fpdt_attention
from tests.helpers.attention_cases import case_errors

FP32_TOL = 2e-5


def _boundaries(mesh, seed: int, docs: int) -> list[int]:
    """Uneven documents (up to one seq_multiple long each, so they straddle chunks) plus padding."""
    g = torch.Generator().manual_seed(seed)
    sm = mesh.seq_multiple  # u·U: one token per piece at the smallest
    lengths = [int(n) for n in torch.randint(1, max(2, 2 * sm), (docs,), generator=g)]
    pad = (-sum(lengths)) % sm
    cu = [0]
    for n in lengths + ([pad] if pad else []):
        cu.append(cu[-1] + n)
    return cu


def _case(mesh, case: dict, dtype: torch.dtype):
    """Offload off and on (error names prefixed "off_"): same numbers through the same schedule."""
    seed = case.get("seed", 0) + 1000 * mesh.dp_rank
    cu = _boundaries(mesh, seed, case.get("docs", 4)) if case.get("packed", True) else None
    return case_errors(
        mesh, case, dtype, attention=fpdt_attention, cu=cu, rows=(2, 2 * mesh.seq_multiple), head_dim=8,
        variants={"": dict(offload=False), "off_": dict(offload=True)},
    )


CASES = [
    dict(heads=8, kv_heads=8),
    dict(heads=8, kv_heads=4, docs=5, seed=1),
    dict(heads=8, kv_heads=1, seed=2),  # MQA: one KV head, replicated for U > 1
    dict(heads=8, kv_heads=2, seed=3),  # H_kv < U for U = 4
    dict(heads=4, kv_heads=2, causal=False, seed=4),  # every query chunk needs every K/V chunk
    dict(heads=4, kv_heads=2, window=5, seed=5),  # early K/V chunks skipped
    dict(heads=4, kv_heads=4, window=3, causal=False, seed=6),
    dict(heads=4, kv_heads=2, softcap=2.0, seed=7),
    dict(heads=4, kv_heads=4, packed=False, seed=8),  # B = 2 rows, one document each
]
