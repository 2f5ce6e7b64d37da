"""FSDP2 plan on gloo (4 ranks, DP 2 × SP 2): one optimizer step equals the single-process step.

The sharded run: a patched tiny Llama, `fsdp_plan(...).apply` (ZeRO-3 over the whole world,
sum reduction), two micro-batches per DP rank with gradient sync only on the last one, each
normalised by the step's GLOBAL valid-target count (invariant 6), then one SGD step. The
reference: the unpatched model in one process on ONE packed batch of all the step's
documents (the global mean loss), same SGD step. Parameters after the step must agree.

SGD, not Adam: Adam's first step is ~lr·sign(g) and would hide a gradient scaled by the
world size (FSDP's default average); with SGD an average instead of a sum leaves the update
4× too small (relative error 0.75). Tolerance: the update lr·g is compared relative to its
largest entry at 1e-4, the gradient tolerance of tests/distributed/test_models.py (fp32,
summation order differs between ring/Ulysses partial sums and one dense softmax).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.families import load, rel, save_family
from tests.helpers.pool import worker_mesh

UPDATE_TOL = 1e-4
LR = 0.5
DP_DOCS = [[[9, 17], [6]], [[21], [5, 11]]]  # DP rank -> micro-batches -> document lengths


def _all_docs():
    return [n for rank in DP_DOCS for mb in rank for n in mb]


def _step_batches(seed: int = 3):
    """Token ids of every document, drawn once so both runs see the same data."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (n,), generator=g).tolist() for n in _all_docs()]


def _flat(docs):
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening(return_position_ids=True, return_tensors="pt")([{"input_ids": d} for d in docs])


def _reference_update(path: str) -> dict[str, torch.Tensor]:
    model = load(path)  # unpatched: HF's own loss
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(**_flat(_step_batches()), use_cache=False).loss.backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


def _meta_or_loaded(path: str, broadcast: bool):
    """Rank 0 loads the weights; with `broadcast` every other rank builds the model on meta."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    if not broadcast or dist.get_rank() == 0:
        return load(path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).train()


def _fsdp_step(path: str, mixed_precision: str, broadcast: bool = False, **memory) -> dict:
    from torch.distributed.tensor import DTensor

    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.integrations.accelerate import fsdp_plan
    from hf_longctx.integrations.model_patch import patch

    mesh = worker_mesh(2, 1)  # ulysses 2 × ring 1 → dp 2
    ref = _reference_update(path)
    model = patch(_meta_or_loaded(path, broadcast), mesh, **memory)
    plan = fsdp_plan(model, mesh, mixed_precision=mixed_precision)
    plan.apply(model, broadcast_from_rank0=broadcast)
    before = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    start = {n: t.detach() for n, t in load(path).state_dict().items()}
    loaded = max(rel(p.full_tensor(), start[n]) for n, p in model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    docs, k = _step_batches(), 0
    by_rank = []
    for rank in DP_DOCS:
        mbs = []
        for mb in rank:
            mbs.append(docs[k : k + len(mb)])
            k += len(mb)
        by_rank.append(mbs)
    total = sum(len(d) - 1 for d in docs)  # valid shifted targets of the whole step
    mine = by_rank[mesh.dp_rank]
    for i, mb in enumerate(mine):
        model.set_requires_gradient_sync(i == len(mine) - 1)
        model(**shard_batch(_flat(mb), mesh, num_items_in_batch=total)).loss.backward()
    opt.step()

    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    local_numel = sum(p.to_local().numel() for p in model.parameters())
    full = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    errs = {n: rel(full[n] - before[n], ref[n]) for n in ref}
    from torch.distributed.fsdp import FSDPModule

    groups: dict[int, list[str]] = {}  # one entry per FSDP unit: the modules grouped in it
    for n, m in model.named_modules():
        if isinstance(m, FSDPModule):
            groups.setdefault(id(m._get_fsdp_state()), []).append(n or "<root>")
    units = sorted("+".join(g) for g in groups.values())
    return {"sharded": sharded, "local_numel": local_numel, "numel": sum(t.numel() for t in full.values()), "errs": errs,
            "units": units, "loaded": loaded, "inv_freq": _inv_freq_ok(model, path)}


def _inv_freq_ok(model, path: str) -> bool:
    """Non-persistent buffers (RoPE inv_freq) equal a freshly loaded model's."""
    ref = dict(load(path).named_buffers())
    return all(torch.equal(b.cpu(), ref[n]) for n, b in model.named_buffers() if n in ref)


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return save_family("llama", tmp_path_factory.mktemp("fsdp"))


def test_fsdp_step_equals_single_process(pools, llama_path):
    results = pools.get(4).run(_fsdp_step, llama_path, "fp32", timeout=240)
    for rank, res in enumerate(results):
        assert res["sharded"], f"rank {rank}: parameters are not DTensors, the model was not sharded"
        # ZeRO-3 over all 4 ranks: each holds about a quarter (dim-0 shards round up).
        assert res["local_numel"] <= res["numel"] / 4 + 256, f"rank {rank}: holds {res['local_numel']} of {res['numel']}"
        worst = max(res["errs"], key=res["errs"].get)
        assert res["errs"][worst] <= UPDATE_TOL, f"rank {rank}: {worst} update rel err {res['errs'][worst]:.2e}"


@pytest.fixture(scope="module")
def tied_paths(tmp_path_factory):
    """GPT-2 (tied by default) and a Llama with tie_word_embeddings=True (the demo's)."""
    import transformers as tf

    from tests.helpers.families import family_config

    root = tmp_path_factory.mktemp("tied")
    paths = {}
    for family in ("gpt2", "llama"):
        cfg = family_config(family)
        cfg.tie_word_embeddings = True
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(cfg)
        assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
        model.save_pretrained(f"{root}/{family}")
        paths[family] = f"{root}/{family}"
    return paths


@pytest.mark.parametrize("memory", [{}, {"loss_chunks": 3}], ids=["hf_loss", "chunked_loss"])
def test_tied_embeddings_one_unit_exact(pools, tied_paths, memory):
    """Tied embedding/LM head: ONE FSDP unit ([embed, head]) resharded after use; the step is
    the single-process step (fp32, 4 gloo ranks), with HF's loss and with the chunked loss
    computed inside the head unit's forward."""
    for family, path in tied_paths.items():
        results = pools.get(4).run(_fsdp_step, path, "fp32", **memory, timeout=240)
        for rank, res in enumerate(results):
            embed = {"gpt2": "transformer.wte", "llama": "model.embed_tokens"}[family]
            assert f"{embed}+lm_head" in res["units"], f"{family}: units {res['units']}"
            assert res["local_numel"] <= res["numel"] / 4 + 256, f"{family} rank {rank}: not sharded"
            worst = max(res["errs"], key=res["errs"].get)
            assert res["errs"][worst] <= UPDATE_TOL, f"{family} rank {rank}: {worst} update rel err {res['errs'][worst]:.2e}"


def test_untied_embeddings_two_units(pools, llama_path):
    res = pools.get(4).run(_fsdp_step, llama_path, "fp32", loss_chunks=2, timeout=240)[0]
    assert {"model.embed_tokens", "lm_head", "<root>"} <= set(res["units"]), res["units"]
    worst = max(res["errs"], key=res["errs"].get)
    assert res["errs"][worst] <= UPDATE_TOL, f"{worst} update rel err {res['errs'][worst]:.2e}"


def test_broadcast_from_rank0_meta_init_step_is_exact(pools, llama_path):
    """Only rank 0 loads the weights, the others build the model on meta; after apply every
    rank holds rank 0's weights (and buffers) and the step equals the single-process step."""
    for rank, res in enumerate(pools.get(4).run(_fsdp_step, llama_path, "fp32", True, timeout=240)):
        assert res["loaded"] == 0.0 and res["inv_freq"], f"rank {rank}: weights/buffers differ from rank 0's {res}"
        worst = max(res["errs"], key=res["errs"].get)
        assert res["errs"][worst] <= UPDATE_TOL, f"rank {rank}: {worst} update rel err {res['errs'][worst]:.2e}"


def test_plan_fields_and_errors(llama_path):
    from accelerate import FullyShardedDataParallelPlugin

    from hf_longctx.distributed.mesh import SPMesh
    from hf_longctx.integrations.accelerate import fsdp_plan

    model = load(llama_path)
    mesh = SPMesh(dp=1, ring=1, ulysses=1, fpdt_chunks=1, dp_rank=0, ring_rank=0, ulysses_rank=0)
    # Precision follows the model unless given: an fp32 model is not silently cast to bf16.
    assert model.dtype == torch.float32
    follow = fsdp_plan(model, mesh)
    assert follow.mixed_precision == "fp32" and follow.plugin.mixed_precision_policy is None
    assert follow._policies()[0].param_dtype is None  # FSDP2 MixedPrecisionPolicy(): no cast
    assert fsdp_plan(load(llama_path).to(torch.bfloat16), mesh).mixed_precision == "bf16"
    plan = fsdp_plan(model, mesh, mixed_precision="bf16")
    assert [c.__name__ for c in plan.layer_classes] == ["LlamaDecoderLayer"]
    assert isinstance(plan.plugin, FullyShardedDataParallelPlugin) and plan.plugin.fsdp_version == 2
    assert plan.plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    assert plan.plugin.reshard_after_forward is True and not plan.plugin.activation_checkpointing
    assert plan.plugin.mixed_precision_policy.param_dtype == torch.bfloat16
    assert plan.plugin.mixed_precision_policy.reduce_dtype == torch.float32
    assert plan.gradient_reduction == "sum" and plan.gradient_divide_factor == 1.0
    # One process without param_offload: nothing to shard (with it: FSDP2 over one rank, test_trainer.py).
    assert plan.device_mesh is None and plan.apply(model) is model
    with pytest.raises(ValueError, match="mixed_precision"):
        fsdp_plan(model, mesh, mixed_precision="fp16")


def test_collectives_take_the_nccl_device(monkeypatch):
    """Under NCCL (emulated: the backend query and the current device are faked) every
    collective of the library runs on the device `torch.cuda.set_device(LOCAL_RANK)` chose,
    unless its tensor already lives on an accelerator; under gloo on CPU."""
    import torch.distributed as dist

    from hf_longctx.distributed.loss import collective_device

    group = object()
    monkeypatch.setattr(dist, "get_backend", lambda g=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collective_device(group) == torch.device("cuda", 3)
    assert collective_device(group, torch.zeros(1)) == torch.device("cuda", 3)  # a CPU tensor moves
    assert collective_device(group, torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert collective_device(None) == torch.device("cpu")  # one process: no collective
    monkeypatch.setattr(dist, "get_backend", lambda g=None: "gloo")
    assert collective_device(group, torch.zeros(1)) == torch.device("cpu")
