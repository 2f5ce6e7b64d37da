"""Attention sinks (HF's `s_aux`) under USP, ring, Ulysses and FPDT vs a float64 single-process reference.

The reference (`tests/reference.reference_attention(..., sinks=)`) is HF's eager GPT-OSS
rule: one extra logit column per head, softmaxed with the scores and dropped. Checked:
forward output, dq/dk/dv and the sink gradient (summed over the SP group, as every
parameter gradient is), for U×R in (1,1), (2,1), (1,2), (2,2), (4,1), (1,4), FPDT u = 2
on 2 ranks and u = 4 on 4 ranks; MHA, GQA with H_kv < U, packed uneven documents with a
padding document, sliding window, B = 2 unpacked rows. The outputs must be contiguous.

Tolerances as in test_usp.py: fp32 relative error <= 2e-5 against float64 (~1e-7 is
measured; a sink merged once per ring step or per FPDT chunk instead of once gives ~1e-1,
a missing sink gradient 1.0); bf16 no worse than twice single-process bf16 attention.
"""

from __future__ import annotations

import pytest
import torch

from hf_longctx import init_sequence_parallel
from tests.distributed import test_fpdt, test_usp
from tests.pool import worker_mesh

FP32_TOL = 2e-5

CASES = [
    dict(heads=8, kv_heads=8, sinks=True, seed=21),
    dict(heads=8, kv_heads=2, docs=5, sinks=True, seed=22),  # GQA; H_kv < U for U = 4 (KV replication)
    dict(heads=4, kv_heads=2, window=5, sinks=True, seed=23),  # sliding window crossing shards
    dict(heads=4, kv_heads=4, packed=False, sinks=True, seed=24),  # B = 2 rows, one document each
]


def _usp(ulysses: int, ring: int, dtype_name: str, cases: list[dict]):
    mesh = worker_mesh(ulysses, ring)
    return [test_usp._case(mesh, c, getattr(torch, dtype_name)) for c in cases]


def _fpdt(ulysses: int, chunks: int, dtype_name: str, cases: list[dict]):
    mesh = worker_mesh(ulysses, 1, chunks)
    return [test_fpdt._case(mesh, c, getattr(torch, dtype_name)) for c in cases]


def _check_fp32(results, layout):
    for rank, per_rank in enumerate(results):
        for case, errs in zip(CASES, per_rank):
            assert any(name.endswith("dsink") for name in errs), errs
            for name, e in errs.items():
                assert e <= FP32_TOL, f"{layout} rank {rank} case {case}: {name} rel err {e:.2e} > {FP32_TOL} ({errs})"


def test_world1_fp32():
    mesh = init_sequence_parallel()
    _check_fp32([[test_usp._case(mesh, c, torch.float32) for c in CASES]], "(1,1)")


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2)])
def test_world2_fp32(pools, ulysses, ring):
    _check_fp32(pools.get(2).run(_usp, ulysses, ring, "float32", CASES), (ulysses, ring))


@pytest.mark.parametrize("ulysses,ring", [(2, 2), (4, 1), (1, 4)])
def test_world4_fp32(pools, ulysses, ring):
    _check_fp32(pools.get(4).run(_usp, ulysses, ring, "float32", CASES), (ulysses, ring))


@pytest.mark.parametrize("world,ulysses,chunks", [(2, 2, 2), (4, 4, 4)])
def test_fpdt_fp32(pools, world, ulysses, chunks):
    _check_fp32(pools.get(world).run(_fpdt, ulysses, chunks, "float32", CASES), f"fpdt U={ulysses} u={chunks}")


def test_bf16_no_worse_than_twice_single_process(pools):
    cases = CASES[1:2]
    for layout, fn, args in (("ring 2", _usp, (1, 2)), ("fpdt U=2 u=2", _fpdt, (2, 2))):
        for rank, per_rank in enumerate(pools.get(2).run(fn, *args, "bfloat16", cases)):
            errs = per_rank[0]
            for name in ("out", "dq", "dk", "dv", "dsink"):
                assert errs[name] <= 2 * errs["base_" + name], f"{layout} rank {rank}: {name} {errs}"
