"""Flexible SP groups on 4 gloo ranks: a step whose slots use different group layouts equals
the single-process step.

The step (`flex/step.run_flex_step`) runs four slots with the layouts
1×[4]; 2×[2]; 1×[2] + 2×[1]; 4×[1] -- changing from slot to slot, one group left empty
(it runs a padding document) -- on a model patched with a `GroupBank`; each micro-batch's
attention takes its group from the batch. The reference: the unpatched model in one process
on ONE packed row of all the step's documents (the global mean loss). Variants: Llama with
GQA (4 heads, 2 KV heads) FSDP2-sharded over the bank's world with activation checkpointing
and FPDT chunks in the ring-1 groups (ranks_per_node 2, so the size-4 group is Ulysses 2 ×
ring 2 and the size-2 groups Ulysses 2 with 2 FPDT chunks); GPT-2 without FSDP (gradients
summed by `sum_gradients`), ranks_per_node 4 (size 4 = Ulysses 4).

Tolerances as tests/distributed/test_models.py (fp32): loss 1e-5 relative (summation order
only), gradients 1e-4 relative to each parameter's largest entry (a parameter gradient sums
contributions whose order differs between ring/FPDT merges and one dense softmax); a lost
target, a wrong group or a wrong scale gives errors of order 1e-2 or more.
"""

from __future__ import annotations

import pytest

from tests.helpers.families import load, rel, save_family
from tests.helpers.pool import worker_bank
from tests.helpers.flex_step import _documents, _flex_step, _plan, check_results


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("flex")
    return {f: save_family(f, root) for f in ("llama", "gpt2")}


@pytest.mark.parametrize(
    "family, ranks_per_node, fpdt_chunks, fsdp, checkpoint, splits, equal_calls, sync_each",
    [
        ("llama", 2, 2, True, True, [(1, 1, 1, 1), (2, 2, 1, 2), (4, 2, 2, 1)], True, False),
        ("llama", 2, 2, True, True, [(1, 1, 1, 1), (2, 2, 1, 2), (4, 2, 2, 1)], True, True),
        ("gpt2", 4, 1, False, False, [(1, 1, 1, 1), (2, 2, 1, 1), (4, 4, 1, 1)], True, False),
        ("llama", 2, 2, True, True, [(1, 1, 1, 1), (2, 2, 1, 2), (4, 2, 2, 1)], False, False),
        ("gpt2", 4, 1, False, False, [(1, 1, 1, 1), (2, 2, 1, 1), (4, 4, 1, 1)], False, False),
    ],
    ids=["llama-gqa-fsdp-fpdt-ckpt", "llama-sync-each-microbatch", "gpt2-sum-gradients", "unequal-llama-gqa-fsdp-fpdt-ckpt",
         "unequal-gpt2-sum-gradients"],
)
def test_mixed_layouts_equal_single_process(pools, paths, family, ranks_per_node, fpdt_chunks, fsdp, checkpoint, splits,
                                            equal_calls, sync_each):
    results = pools.get(4).run(_flex_step, paths[family], ranks_per_node, fpdt_chunks, fsdp, checkpoint, equal_calls,
                               sync_each, timeout=300)
    check_results(results, splits, equal_calls)
    for rank, res in enumerate(results):  # one reduce-scatter per FSDP unit per step, or per micro-batch if asked
        expected = res["units"] * (res["calls"] if sync_each else 1) if fsdp else 0
        assert res["scatters"] == expected, f"rank {rank}: {res['scatters']} reduce-scatters, expected {expected}"


def test_hand_written_loop_on_fp32_model_computes_in_fp32(pools, paths):
    """`fsdp_plan(model, bank.world)` without mixed_precision on an fp32 model: every linear
    layer computes in fp32 and the step equals the fp32 single-process step at fp32
    tolerances (a silent bf16 cast instead computes the linear layers in bf16 and
    misses the loss: 1.6e-5 relative on this tiny model, above the 1e-5 fp32 tolerance)."""
    results = pools.get(4).run(_flex_step, paths["llama"], 2, 2, True, True, True, False, None, timeout=300)
    check_results(results, [(1, 1, 1, 1), (2, 2, 1, 2), (4, 2, 2, 1)], True)
    for rank, res in enumerate(results):
        assert res["dtypes"] == ["torch.float32"], f"rank {rank}: linear layers computed in {res['dtypes']}"


def _disagreeing_plans() -> str:
    """Rank 3 plans differently (documents swapped between groups): every rank must raise
    the same clear error from the fingerprint check, before any forward."""
    import torch.distributed as dist

    from hf_longctx.flex.plan import FlexGroup, FlexPlan
    from hf_longctx.flex.step import flex_microbatches

    bank = worker_bank(heads=4, ranks_per_node=4)
    a, b = (0, 1), (2, 3)
    if dist.get_rank() == 3:
        a, b = b, a
    plan = FlexPlan(slots=((FlexGroup(2, 0, a), FlexGroup(2, 1, b)),), lengths=(5, 6, 7, 8), world_size=4,
                    max_tokens_per_rank=32, shapes=bank.shapes)
    try:
        next(flex_microbatches(plan, bank, [[1] * n for n in (5, 6, 7, 8)]))
    except ValueError as e:
        return str(e)
    return "no error"


def test_plans_that_differ_across_ranks_are_refused(pools):
    for rank, msg in enumerate(pools.get(4).run(_disagreeing_plans, timeout=120)):
        assert "different flexible plans" in msg, f"rank {rank}: {msg}"


def _unsharded_refusals(path: str) -> dict:
    """The unequal-count mode refuses, on every rank together and before any micro-batch:
    FSDP parameter offload, and a step whose unsharded parameters and gradients do not fit
    one rank's free device memory (rank 2 reports 0 bytes free; CPU has no device limit)."""
    import torch.distributed as dist

    from hf_longctx.flex.step import run_flex_step
    from hf_longctx.flex.unsharded_step import unsharded_bytes, check_unsharded_step
    from hf_longctx.integrations.accelerate import fsdp_plan
    from hf_longctx.integrations.model_patch import patch

    bank = worker_bank(heads=4, ranks_per_node=4)
    out = {}
    model = patch(load(path), bank)
    fsdp_plan(model, bank.world, mixed_precision="fp32", param_offload=True).apply(model)
    try:
        run_flex_step(model, bank, _plan(bank, equal_calls=False), _documents())
        out["offload"] = "no error"
    except ValueError as e:
        out["offload"] = str(e)
    model = patch(load(path), bank)
    numel = sum(p.numel() for p in model.parameters())
    fsdp_plan(model, bank.world, mixed_precision="bf16").apply(model)
    out["bytes"], out["expected"] = unsharded_bytes(model), numel * (2 + 4)  # bf16 parameters, fp32 gradients
    out["gathered"] = unsharded_bytes(model, gradients=False)  # a rollout's gathered weights: bf16 parameters
    try:
        check_unsharded_step(model, bank.world_mesh.get_group(), free_bytes=lambda: 0 if dist.get_rank() == 2 else None)
        out["memory"] = "no error"
    except ValueError as e:
        out["memory"] = str(e)
    return out


def test_unequal_calls_refusals(pools, paths):
    for rank, res in enumerate(pools.get(4).run(_unsharded_refusals, paths["llama"], timeout=120)):
        assert "param_offload" in res["offload"], f"rank {rank}: {res['offload']}"
        assert res["bytes"] == res["expected"], f"rank {rank}: unsharded bytes {res['bytes']} != {res['expected']}"
        assert res["gathered"] == res["expected"] // 3, f"rank {rank}: gathered weights {res['gathered']} bytes"
        assert "plan with equal counts" in res["memory"], f"rank {rank}: {res['memory']}"
        assert ("this rank has 0.00 GiB free" in res["memory"]) == (rank == 2), f"rank {rank}: {res['memory']}"


def _bf16_unsharded_vs_default(path: str) -> dict:
    """FSDP2 with bf16 parameters and fp32 reduction (the default GPU regime): the SAME
    micro-batches (the equal-count slots, which also satisfy the unequal mode's closing
    rule) run once the default way (reshard per unit, sync in the last backward) and once
    through `unsharded_step`. Both run the same kernels on the same gathered bf16 parameters,
    accumulate the unsharded gradients in fp32 in the same order and reduce-scatter once, so
    they must be bitwise equal on CPU (and the gradients must not be zero). The default path
    itself is checked against the float64 truth in test_bf16.py."""
    from hf_longctx.flex.plan import FlexPlan
    from hf_longctx.flex.step import run_flex_step
    from hf_longctx.integrations.accelerate import fsdp_plan
    from hf_longctx.integrations.model_patch import patch

    bank = worker_bank(heads=4, ranks_per_node=2, fpdt_chunks=2)
    out = []
    for equal in (True, False):
        model = patch(load(path), bank, checkpoint=True)
        fsdp_plan(model, bank.world, mixed_precision="bf16").apply(model)
        base = _plan(bank)
        plan = FlexPlan(slots=base.slots, lengths=base.lengths, world_size=4, max_tokens_per_rank=32, shapes=bank.shapes,
                        equal_calls=equal)
        loss = run_flex_step(model, bank, plan, _documents())
        out.append((float(loss), {n: p.grad.full_tensor().float() for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = out
    return {"loss": abs(l0 - l1) / abs(l0), "grads": max(rel(g1[n], g0[n]) for n in g0),
            "norm": min(float(g.norm()) for g in g0.values())}


def test_bf16_unsharded_step_matches_default(pools, paths):
    for rank, res in enumerate(pools.get(4).run(_bf16_unsharded_vs_default, paths["llama"], timeout=300)):
        assert res["norm"] > 0, f"rank {rank}: a zero gradient"
        assert res["loss"] == 0.0 and res["grads"] == 0.0, f"rank {rank}: {res}"
