"""`LongContextTrainer` on 4 gloo ranks equals the same trainer in one process (fp32).

Every case trains 3 AdamW steps (cosine schedule, warm-up, clipping at 1.0) of a tiny model
loaded with `from_pretrained`, FSDP2 over all 4 ranks, then `evaluate()`s. The single-process
run (pytest's own process: no process group, mesh of 1) draws the same steps and plans the
same micro-batches (the planner is deterministic given dp; with dp 1 vs 2 the PIECES are the
same documents, only their rank assignment differs). The logged loss and `grad_norm` of
every step and the eval loss must agree within 1e-5 relative: fp32 on CPU, where
re-ordering a sum of ~10^3 token terms changes the result by ~1e-7; a lost target, a
`num_processes` factor or an averaged (instead of summed) reduction is off by >= 1e-2, and
the grad norm would show a clipping of the wrong gradient. The bf16 case compares at 2e-2:
bf16 keeps 8 mantissa bits (2^-8 ≈ 4e-3 relative per rounding), and FSDP's bf16 parameter
copies round differently from autocast's, over 3 steps.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.families import save_family
from tests.helpers.pool import worker_mesh
from tests.helpers.trainer_cases import BF16_TOL, assert_steps_close, history, make_dataset, training_args

TOL = 1e-5
MESHES = {"u2xr2": (2, 2, 1), "dp2xu2": (2, 1, 1), "fpdt_u2": (2, 1, 2)}


def _run(path: str, degrees: tuple[int, int, int] | None, output_dir: str, lora: bool = False, bf16: bool = False,
         sync_each_microbatch: bool = False, param_offload: bool = False) -> dict:
    from transformers import AutoModelForCausalLM

    from hf_longctx import LongContextTrainer, init_sequence_parallel, patch

    args = training_args(output_dir, bf16=bf16)  # first: it adopts the process group
    mesh = worker_mesh(*degrees) if degrees else init_sequence_parallel()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)  # LoRA B starts at 0, A from this seed: the same on every rank and in one process
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights="gaussian"))
    patch(model, mesh)
    ds = make_dataset(masked=True)
    trainer = LongContextTrainer(model=model, args=args, train_dataset=ds, eval_dataset=make_dataset(8, seed=1),
                                 mesh=mesh, max_tokens=48, tokens_per_step=120, sync_each_microbatch=sync_each_microbatch,
                                 param_offload=param_offload)
    trainer.train()
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    groups = [m._get_fsdp_state()._fsdp_param_group for m in trainer.model.modules() if isinstance(m, FSDPModule)]
    last = trainer.last_plan
    import torch.distributed as dist

    record = os.path.join(output_dir, f"last_plan_{dist.get_rank() if dist.is_initialized() else 0}.json")
    last.save(record)
    return {"last_plan": {"record": record, "slot_tokens": sum(n for slot in last.slot_tokens() for _, n in slot),"step": last.step, "tokens": sum(last.lengths), "pieces": len(last.plan.pieces),
                          "lengths": len(last.lengths), "slots": len(last.plan.ranks[0]), "times": last.microbatch_s,
                          "measured": last.measured_s, "modelled": last.modelled, "groups": last.groups},
            "steps": history(trainer), "eval": trainer.evaluate()["eval_loss"],
            "balance": [h.get("plan_balance") for h in trainer.state.log_history if "loss" in h],
            "offloaded": [isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups if g is not None]}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    return {f: save_family(f, root) for f in ("llama", "gpt2")}


@pytest.fixture(scope="module")
def reference(paths, tmp_path_factory):
    """Single-process runs, computed once per model/variant."""
    cache = {}

    def get(family: str, **kw):
        key = (family, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = _run(paths[family], None, str(tmp_path_factory.mktemp("ref")), **kw)
        return cache[key]

    return get


@pytest.mark.parametrize("family,mesh", [("llama", "u2xr2"), ("llama", "dp2xu2"), ("llama", "fpdt_u2"), ("gpt2", "dp2xu2")])
def test_trainer_matches_single_process(pools, paths, reference, tmp_path, family, mesh):
    ref = reference(family)
    out = pools.get(4).run(_run, paths[family], MESHES[mesh], str(tmp_path), timeout=600)
    for rank, res in enumerate(out):
        assert_steps_close(res["steps"], ref["steps"], TOL, f"{family} {mesh} rank {rank}")
        assert res["eval"] == pytest.approx(ref["eval"], rel=TOL), f"rank {rank}: eval loss {res['eval']} vs {ref['eval']}"
    if MESHES[mesh][0] * MESHES[mesh][1] == 2:  # dp 2: the plan's balance is logged
        assert all(b is not None and b >= 1.0 for b in out[0]["balance"])
        # trainer.last_plan: the last (3rd) step's plan, its modelled balance, this rank's measured micro-batch times.
        for rank, res in enumerate(out):
            last = res["last_plan"]
            assert last["step"] == 3 and last["lengths"] == last["pieces"] and last["tokens"] > 0, f"rank {rank}: {last}"
            assert len(last["times"]) == last["slots"] >= 1 and all(t > 0 for t in last["times"]), f"rank {rank}: {last}"
            assert last["measured"] == pytest.approx(sum(last["times"]))
            assert last["modelled"]["synced_over_ideal"] == pytest.approx(out[0]["balance"][-1])
            assert last["groups"] == ["[2 DP rank(s)]"] * last["slots"]
            assert last["slot_tokens"] == last["tokens"]  # every planned piece in some slot
        # `hf-longctx step-plot` draws the saved record.
        from hf_longctx.cli import main

        png = tmp_path / "last_plan.png"
        assert main(["step-plot", out[0]["last_plan"]["record"], "--out", str(png)]) == 0
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sync_each_microbatch_matches_single_process(pools, paths, reference, tmp_path):
    """`sync_each_microbatch=True`: FSDP2 reduce-scatters in every micro-batch's backward and
    accumulates the gradients sharded; the steps still equal the single-process run."""
    ref = reference("llama")
    out = pools.get(4).run(_run, paths["llama"], MESHES["dp2xu2"], str(tmp_path), sync_each_microbatch=True, timeout=600)
    for rank, res in enumerate(out):
        assert_steps_close(res["steps"], ref["steps"], TOL, f"sync each micro-batch rank {rank}")


def test_param_offload_matches_single_process(pools, paths, reference, tmp_path):
    """`param_offload=True` reaches FSDP2 (every unit has a CPUOffloadPolicy: shards, gradients
    and optimizer states in host memory, the AdamW step on the CPU); the steps still equal the
    single-process run."""
    ref = reference("llama")
    out = pools.get(4).run(_run, paths["llama"], MESHES["dp2xu2"], str(tmp_path), param_offload=True, timeout=600)
    for rank, res in enumerate(out):
        assert res["offloaded"] and all(res["offloaded"]), f"rank {rank}: offload policies {res['offloaded']}"
        assert_steps_close(res["steps"], ref["steps"], TOL, f"param offload rank {rank}")


def _resident_after_steps(path: str, output_dir: str) -> dict:
    """One process (a 1-rank gloo group), `param_offload=True`: 3 steps with the model placed on
    the "device" as `Trainer` places it, tracked by `benchmarks/_counting.Counter` (on CPU it tells
    device from host memory by provenance: `.cpu()` of a device tensor is host, an op on a
    device tensor makes a device tensor, `.to(device)` of a host tensor is an upload)."""
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from benchmarks._counting import Counter
    from hf_longctx import LongContextTrainer, init_sequence_parallel, patch

    args = training_args(output_dir)
    mesh = init_sequence_parallel()
    model = patch(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), mesh)
    counter = Counter()
    counter.mark_module(model)  # on the device, as after model.to("cuda")
    with counter.counting():
        trainer = LongContextTrainer(model=model, args=args, train_dataset=make_dataset(masked=True), mesh=mesh,
                                     max_tokens=48, tokens_per_step=120, param_offload=True)
        trainer.train()
    local = [p.to_local() if isinstance(p, DTensor) else p for p in trainer.model.parameters()]
    states = [v.to_local() if isinstance(v, DTensor) else v for st in trainer.optimizer.state.values()
              for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"steps": history(trainer), "param_bytes": sum(t.nbytes for t in local),
            "params_on_device": sum(t.nbytes for t in local if counter.is_device(t)), "tensors": len(local),
            "state_bytes": sum(t.nbytes for t in states),
            "states_on_device": sum(t.nbytes for t in states if counter.is_device(t)), "uploads": counter.counts["h2d"]}


def test_param_offload_in_one_process_keeps_parameters_off_the_device(pools, paths, reference, tmp_path):
    """One process with `param_offload=True` (what `hf-longctx plan --gpus 1` suggests): FSDP2 over
    one rank with CPUOffloadPolicy. After 3 steps no byte of the parameters or of AdamW's states
    is on the device (a model left whole on the device has all 107,136 parameter bytes and the
    214,272 state bytes there; FSDP2 without the offload policy keeps the parameter shards
    there: both seen failing), every parameter is uploaded for compute (at least one upload
    each), and the steps equal the run without offload (fp32, 1e-5 relative)."""
    ref = reference("llama")
    (res,) = pools.get(1).run(_resident_after_steps, paths["llama"], str(tmp_path), timeout=600)
    assert res["param_bytes"] > 0 and res["params_on_device"] == 0, res
    assert res["state_bytes"] == 2 * res["param_bytes"] and res["states_on_device"] == 0, res
    assert res["uploads"] >= res["tensors"], res
    assert_steps_close(res["steps"], ref["steps"], TOL, "param offload, one process")


def test_lora_trainer_matches_single_process(pools, paths, reference, tmp_path):
    ref = reference("llama", lora=True)
    out = pools.get(4).run(_run, paths["llama"], MESHES["dp2xu2"], str(tmp_path), lora=True, timeout=600)
    for rank, res in enumerate(out):
        assert_steps_close(res["steps"], ref["steps"], TOL, f"lora rank {rank}")


def test_bf16_trainer_matches_single_process_bf16(pools, paths, reference, tmp_path):
    ref = reference("llama", bf16=True)
    out = pools.get(4).run(_run, paths["llama"], MESHES["u2xr2"], str(tmp_path), bf16=True, timeout=600)
    fp32 = reference("llama")
    for rank, res in enumerate(out):
        assert_steps_close(res["steps"], ref["steps"], BF16_TOL, f"bf16 rank {rank}")
    # bf16 really ran: it is not bit-identical to fp32
    assert out[0]["steps"][0][0] != fp32["steps"][0][0]
