"""Multi-GPU (NCCL) equivalence: the CPU distributed tests' cases and criteria on real GPUs.

One process per GPU (`pools.get(n, backend="nccl")`: tests/helpers/pool.py, rank r on cuda:r);
marked `multi_gpu`, skipped below 2 visible GPUs (tests/gpu/conftest.py), the 4-GPU cases
below 4. Every check is the CPU test's own, with the same tolerances and the same reasons:
1. USP and FPDT attention forward + dq/dk/dv (tests/distributed/test_usp.py, test_fpdt.py,
   test_sinks.py cases: GQA/MQA with H_kv < U, packed uneven documents, non-causal, window,
   softcap, sinks, B = 2 rows) against the float64 reference: fp32 relative error <= 2e-5
   (on CUDA fp32 runs the math kernel -- no fast kernel takes fp32 -- and TF32 is off by
   default for matmuls, so the CPU bound holds); bf16 no worse than twice single-process
   bf16 attention on the same input. U×R (2,1), (1,2) on 2 GPUs; (2,2), (4,1), (1,4) on 4;
   FPDT u = 2 with offload off and on (real pinned host copies on side streams).
2. A patched tiny Llama (GQA) and GPT-2 from `from_pretrained`, loaded on the host and sharded
   by `fsdp_plan(mixed_precision="bf16").apply`, the batch on the GPU: per tensor
   ‖g − g64‖ ≤ 2·‖g₁ − g64‖ + 1e-6·‖g64‖ (tests/helpers/bf16_rule.excess, small tensors pooled), g64 the
   float64 model on the host, g₁ the unpatched bf16 model on one GPU.
3. `LongContextTrainer` with bf16=True, 2 steps on 2 GPUs vs the same trainer on one GPU:
   logged loss and grad_norm within BF16_TOL of tests/helpers/trainer_cases.py (one bf16 rounding step, 2^-8).
4. Flexible SP groups on 4 GPUs (tests/helpers/flex_step.py, test_flex.py's step, fp32, FSDP2 over
   the world, FPDT chunks in the ring-1 groups, checkpointing): equal counts (layouts
   [4]; [2,2]; [2,1,1]; [1,1,1,1]) and unequal counts (5/3/4/4 micro-batches per rank, the
   model unsharded for the step: the NCCL ordering of the world reduce-scatters against
   the groups' collectives that FlexPlan's closing rule exists for), against the host's
   single-process loss and gradients at test_flex's tolerances.

The sinks cases run in a pool whose group is "cpu:gloo,cuda:nccl": `case_errors` sums the
sink gradient of its host copy over the SP group, a host-side step of the harness; every
other test here runs on a pure NCCL group, so a collective on host tensors inside the
library fails as it would for a user.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import bf16_rule, fpdt_cases, sink_cases, usp_cases
from tests.gpu import multi_gpu_tasks as tasks
from tests.helpers.trainer_cases import BF16_TOL, assert_steps_close

tasks.check_signatures()  # at collection: a CPU machine fails here on a call the GPU run would refuse
pytestmark = pytest.mark.multi_gpu
needs4 = pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 visible CUDA devices")
NCCL, MIXED = "nccl", "cpu:gloo,cuda:nccl"
GPU_LAYOUTS = [pytest.param(2, 2, 1, id="u2"), pytest.param(2, 1, 2, id="r2"), pytest.param(4, 2, 2, id="u2xr2", marks=needs4),
               pytest.param(4, 4, 1, id="u4", marks=needs4), pytest.param(4, 1, 4, id="r4", marks=needs4)]


def _check_fp32(results, cases, tol):
    for rank, per_rank in enumerate(results):
        for case, errs in zip(cases, per_rank):
            for name, e in errs.items():
                assert e <= tol, f"rank {rank} case {case}: {name} rel err {e:.2e} > {tol}"


def _check_bf16(results, cases, tags=("",)):
    for rank, per_rank in enumerate(results):
        for case, errs in zip(cases, per_rank):
            names = [n for n in ("out", "dq", "dk", "dv", "dsink") if "base_" + n in errs]
            for tag in tags:
                for name in names:
                    assert errs[tag + name] <= 2 * errs["base_" + name], f"rank {rank} {case}: {tag}{name} {errs}"
                assert errs[tag + "contiguous"] == 0.0, f"rank {rank} {case}: {tag}output not contiguous"


# ---- 1. attention ------------------------------------------------------------------------


@pytest.mark.parametrize("world,ulysses,ring", GPU_LAYOUTS)
def test_usp_fp32(pools, world, ulysses, ring):
    res = pools.get(world, NCCL).run(tasks.usp_cases, ulysses, ring, "float32", usp_cases.CASES)
    _check_fp32(res, usp_cases.CASES, usp_cases.FP32_TOL)


@pytest.mark.parametrize("world,ulysses,ring", GPU_LAYOUTS)
def test_usp_bf16(pools, world, ulysses, ring):
    # every fp32 case (window, softcap, GQA, unpacked) in bf16: the cases the fast kernels take
    res = pools.get(world, NCCL).run(tasks.usp_cases, ulysses, ring, "bfloat16", usp_cases.CASES)
    _check_bf16(res, usp_cases.CASES)


@pytest.mark.parametrize("world,ulysses,ring", GPU_LAYOUTS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_usp_sinks(pools, world, ulysses, ring, dtype):
    res = pools.get(world, MIXED).run(tasks.usp_cases, ulysses, ring, dtype, sink_cases.CASES)
    if dtype == "float32":
        _check_fp32(res, sink_cases.CASES, sink_cases.FP32_TOL)
    else:
        _check_bf16(res, sink_cases.CASES)


@pytest.mark.parametrize("world,ulysses", [(2, 2), pytest.param(4, 4, marks=needs4)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fpdt_u2_offload(pools, world, ulysses, dtype):
    res = pools.get(world, NCCL).run(tasks.fpdt_cases, ulysses, 2, dtype, fpdt_cases.CASES)
    if dtype == "float32":
        _check_fp32(res, fpdt_cases.CASES, fpdt_cases.FP32_TOL)
    else:
        _check_bf16(res, fpdt_cases.CASES, tags=("", "off_"))


def test_fpdt_u2_sinks(pools):
    res = pools.get(2, MIXED).run(tasks.fpdt_cases, 2, 2, "float32", sink_cases.CASES)
    _check_fp32(res, sink_cases.CASES, sink_cases.FP32_TOL)


# ---- 2. patched models under FSDP2 bf16 ------------------------------------------------------


@pytest.fixture(scope="module")
def model_refs(tmp_path_factory):
    """Saved Llama/GPT-2, and per family (g64 on the host in float64, g₁ on one GPU in bf16)."""
    from tests.helpers.families import save_family

    root = tmp_path_factory.mktemp("multi_gpu_models")
    paths = {f: save_family(f, root) for f in ("llama", "gpt2")}
    refs = {f: (bf16_rule._single(bf16_rule._fresh(p, torch.float32).double(), False), tasks.single_gpu(p, torch.bfloat16))
            for f, p in paths.items()}
    return paths, refs


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("world,degrees", [
    pytest.param(2, (2, 1, 1), id="u2"), pytest.param(2, (1, 2, 1), id="r2"), pytest.param(2, (2, 1, 2), id="fpdt_u2"),
    pytest.param(4, (2, 2, 1), id="u2xr2", marks=needs4), pytest.param(4, (2, 1, 1), id="dp2xu2", marks=needs4),
])
def test_fsdp_bf16_step(pools, model_refs, family, world, degrees):
    paths, refs = model_refs
    results = pools.get(world, NCCL).run(tasks.fsdp_step, paths[family], degrees, *refs[family], timeout=300)
    bf16_rule._check([{(family, "fsdp", degrees): r} for r in results])


# ---- 3. LongContextTrainer bf16 ------------------------------------------------------------


@pytest.mark.parametrize("degrees", [(2, 1, 1), (1, 2, 1)], ids=["u2", "r2"])
def test_trainer_bf16_two_gpus(pools, model_refs, tmp_path, degrees):
    path = model_refs[0]["llama"]
    ref = tasks.trainer_run(path, None, str(tmp_path / "ref"), 2)  # one GPU, pytest's own process
    out = pools.get(2, NCCL).run(tasks.trainer_run, path, degrees, str(tmp_path / "sp"), 2, timeout=600)
    for rank, steps in enumerate(out):
        assert_steps_close(steps, ref, BF16_TOL, f"bf16 trainer {degrees} rank {rank}")


# ---- 4. flexible SP groups ------------------------------------------------------------------


@needs4
@pytest.mark.parametrize("equal_calls", [True, False], ids=["equal-calls", "unequal-calls"])
def test_flex_step_four_gpus(pools, tmp_path, equal_calls):
    from tests.helpers import flex_step
    from tests.helpers.families import save_family

    path = save_family("llama", tmp_path)
    results = pools.get(4, NCCL).run(flex_step._flex_step, path, 2, 2, True, True, equal_calls, timeout=300)
    flex_step.check_results(results, [(1, 1, 1, 1), (2, 2, 1, 2), (4, 2, 2, 1)], equal_calls)
