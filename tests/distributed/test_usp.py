"""USP attention (Ulysses × zigzag ring) forward and dq/dk/dv vs a float64 single-process reference.

Every (ulysses, ring) factorisation of world sizes 1, 2 and 4 (dp > 1 included), GQA with
H_kv = H, H/2, 1 and H_kv < U, packed documents of uneven lengths, non-causal, sliding
window and softcap. Tolerances:
- fp32: relative error max|a-b|/max|b| <= 2e-5 against float64 -- the fp32 kernels
  accumulate in fp32 over at most a few hundred keys, so ~1e-6 is expected and 2e-5 leaves
  room only for summation order, not for a wrong mask or a lost block;
- bf16: no worse than twice the error of single-process bf16 attention on the same input
  (the distributed merge may round differently, but must not add error of its own order).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_longctx import init_sequence_parallel
from hf_longctx.ops.ring import ring_work
from hf_longctx.ops.usp import usp_attention
from tests.helpers.pool import worker_mesh
from tests.helpers.usp_cases import CASES, FP32_TOL, _case


def _run_cases(ulysses: int, ring: int, dtype_name: str, cases: list[dict]):
    mesh = worker_mesh(ulysses, ring)
    return [_case(mesh, c, getattr(torch, dtype_name)) for c in cases]


def _check_fp32(results):
    for rank, per_rank in enumerate(results):
        for case, errs in zip(CASES, per_rank):
            for name, e in errs.items():
                assert e <= FP32_TOL, f"rank {rank} case {case}: {name} rel err {e:.2e} > {FP32_TOL}"


def test_world1_fp32():
    mesh = init_sequence_parallel()
    _check_fp32([[_case(mesh, c, torch.float32) for c in CASES]])


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2), (1, 1)])
def test_world2_fp32(pools, ulysses, ring):
    _check_fp32(pools.get(2).run(_run_cases, ulysses, ring, "float32", CASES))


@pytest.mark.parametrize("ulysses,ring", [(4, 1), (1, 4), (2, 2), (2, 1), (1, 2)])
def test_world4_fp32(pools, ulysses, ring):
    _check_fp32(pools.get(4).run(_run_cases, ulysses, ring, "float32", CASES))


BF16_CASES = [dict(heads=8, kv_heads=2, docs=3, seed=11), dict(heads=4, kv_heads=4, softcap=2.0, seed=12)]


@pytest.mark.parametrize("world,ulysses,ring", [(2, 1, 2), (4, 2, 2)])
def test_bf16_no_worse_than_twice_single_process(pools, world, ulysses, ring):
    for rank, per_rank in enumerate(pools.get(world).run(_run_cases, ulysses, ring, "bfloat16", BF16_CASES)):
        for case, errs in zip(BF16_CASES, per_rank):
            for name in ("out", "dq", "dk", "dv"):
                assert errs[name] <= 2 * errs["base_" + name], f"rank {rank} {case}: {name} {errs}"


@pytest.mark.parametrize("ring", [2, 4, 8])
def test_zigzag_balances_causal_work(ring):
    cu = [0, 16 * ring, 16 * ring + 4 * ring, 16 * ring + 4 * ring + 30 * ring * 2]
    totals = {sum(ring_work(cu, ring, r)) for r in range(ring)}
    assert len(totals) == 1, totals
    # and the work is the causal half of the score matrix, not more
    assert totals.pop() * ring == sum((b - a) * (b - a + 1) // 2 for a, b in zip(cu[:-1], cu[1:]))


# ---- bad input: ValueError on every rank before any collective, then the group still works ----


def _bad_inputs():
    errors = []
    try:
        init_sequence_parallel(3, 1)
    except ValueError as e:
        errors.append(str(e))
    mesh = worker_mesh(2, 2)
    x = torch.zeros(1, 4, 6, 8)
    checks = [
        # H = 6, H_kv = 3, U = 2: 3 query heads per rank but KV groups of 2
        lambda: usp_attention(x, torch.zeros(1, 4, 3, 8), torch.zeros(1, 4, 3, 8), mesh, cu_seqlens=[0, 16]),
        # document of 6 tokens with ring 2 (doc_multiple 4)
        lambda: usp_attention(x, x, x, mesh, cu_seqlens=[0, 6, 16]),
        # k / v shapes differ
        lambda: usp_attention(x, x, torch.zeros(1, 4, 6, 4), mesh, cu_seqlens=[0, 16]),
        # boundaries do not cover the SP group's tokens
        lambda: usp_attention(x, x, x, mesh, cu_seqlens=[0, 12]),
    ]
    for check in checks:
        try:
            check()
        except ValueError as e:
            errors.append(str(e))
    t = torch.ones(1)
    dist.all_reduce(t)  # every rank reaches the next collective: nobody is stuck in a half-started one
    return errors, t.item()


def test_bad_input_raises_everywhere_without_hang(pools):
    results = pools.get(4).run(_bad_inputs, timeout=60)
    for errors, total in results:
        assert total == 4.0
        assert len(errors) == 5, errors
        assert "ulysses(3) x ring(1) = 3 does not divide world size 4" in errors[0]
        assert "heads not divisible after replication" in errors[1] and "6 query heads" in errors[1]
        assert "document 0 has length 6" in errors[2]
        assert "k and v shapes differ" in errors[3]
        assert "cu_seqlens ends at 12" in errors[4] and "= 16" in errors[4]


# ---- bf16: fp32 merges, one rounding ---------------------------------------------------

# Measured (CPU, this test's inputs, 16K elements per tensor; see test_fpdt.py for FPDT):
# with fp32 ring partials rounded once, 0.02 % of the outputs (and <= 0.22 % of the
# gradients, which the ring always summed in fp32) differ from the correctly rounded float64
# value; with each ring step's partial rounded to bf16 before the merge, 17-19 % of the
# outputs do. 1 % separates the two by ~5x either way.
ROUNDING_TOL = 0.01


def _rounding(ulysses: int, ring: int):
    from tests.helpers.attention_cases import rounding_mismatch

    return rounding_mismatch(worker_mesh(ulysses, ring), usp_attention, [0, 100, 256])


@pytest.mark.parametrize("world,ulysses,ring", [(2, 1, 2), (4, 2, 2)])
def test_bf16_ring_rounds_once(pools, world, ulysses, ring):
    for rank, fractions in enumerate(pools.get(world).run(_rounding, ulysses, ring)):
        for name, f in fractions.items():
            assert f <= ROUNDING_TOL, f"({ulysses},{ring}) rank {rank}: {name} differs from the single rounding in {f:.2%} {fractions}"
