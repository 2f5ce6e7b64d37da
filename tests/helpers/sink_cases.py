"""The attention-sink cases (HF's `s_aux`) and their fp32 tolerance.

CASES: MHA, GQA with H_kv < U (KV replication), a sliding window crossing shards and B = 2
unpacked rows, each with sinks; they run through `usp_cases._case` / `fpdt_cases._case`.
FP32_TOL (relative, 2e-5, as for USP) is justified in tests/distributed/test_sinks.py.
Shared by test_sinks.py and tests/gpu/.
"""

from __future__ import annotations

FP32_TOL = 2e-5

CASES = [
    dict(heads=8, kv_heads=8, sinks=True, seed=21),
    dict(heads=8, kv_heads=2, docs=5, sinks=True, seed=22),  # GQA; H_kv < U for U = 4 (KV replication)
    dict(heads=4, kv_heads=2, window=5, sinks=True, seed=23),  # sliding window crossing shards
    dict(heads=4, kv_heads=4, packed=False, sinks=True, seed=24),  # B = 2 rows, one document each
]
