"""MoE models whose router sends no token of one rank's shard to some expert: MoE never
desynchronises the ranks.

Under SP every rank runs the MoE block on its own tokens only, so an expert may receive tokens
on one rank and none on another: there its parameters have `grad is None`. Skipping them on that rank only would make the
ranks' all-reduce buckets differ (gloo "Received data size doesn't match expected size ...
collective mismatch", a hang or a wrong sum under NCCL), and FSDP2 would leave them out of
that rank's reduce-scatter.

The routing is FORCED, not hoped for: a tiny LongCat-Flash (routed experts + identity "zero"
experts, experts fused in two parameters) whose embedding puts ±5 in hidden dimension 0 (+ for
token ids < 64, - for ids >= 64) and whose router scores dimension 0 (+ for the zero experts,
- for the routed ones). A document of ids >= 64 followed by ids < 64 puts the routed experts'
tokens on the first half of the Ulysses ranks only: the other ranks route every token to the
identity experts, so the routed experts' `gate_up_proj` / `down_proj` get no gradient there.
Each test asserts that precondition on the ranks before checking the gradients.

Paths, each on 2 and 4 gloo ranks: `sum_gradients` (hand-written loop, no FSDP), FSDP2 through
`fsdp_plan`, `LongContextTrainer` (2 optimizer steps against the single-process trainer) and the
flexible step `run_flex_step` with and without FSDP2 (float64: see `_flex_run`).
Tolerances as in test_models.py (fp32: loss 1e-5, gradients 1e-4 relative).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.families import compare
from tests.helpers.pool import worker_mesh

LOSS_TOL = 1e-5
GRAD_TOL = 1e-4
EXPERT_PARAMS = ("experts.gate_up_proj", "experts.down_proj")


def moe_config():
    import transformers as tf

    from benchmarks.zoo import tiny_config

    cfg = tiny_config(tf.CONFIG_MAPPING["longcat_flash"])
    cfg.num_hidden_layers, cfg.zero_expert_num = 2, 2  # 4 routed + 2 identity experts, top-2
    return cfg


def save_moe(root) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(moe_config(), dtype=torch.float32)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight  # [V, hidden]
        emb[:, 0] = torch.where(torch.arange(emb.shape[0]) < 64, 5.0, -5.0)
        n_routed = model.config.n_routed_experts  # the config's count: the experts module's attribute is renamed across releases
        for layer in model.model.layers:
            router = layer.mlp.router.classifier.weight  # [routed + zero experts, hidden]
            router[:n_routed, 0], router[n_routed:, 0] = -2.0, 2.0
    path = f"{root}/longcat_moe"
    model.save_pretrained(path)
    return path


def moe_batch(sp: int) -> dict:
    """One document: the first half ids >= 64 (routed experts), the second half ids < 64
    (identity experts); 8 tokens per rank, so with Ulysses the halves fall on different ranks."""
    g = torch.Generator().manual_seed(0)
    n = 8 * sp
    ids = torch.cat([torch.randint(64, 128, (n // 2,), generator=g), torch.randint(1, 64, (n // 2,), generator=g)])
    return {"input_ids": ids[None], "labels": ids[None].clone(), "position_ids": torch.arange(n)[None]}


def _load(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).train()
    if dtype == torch.float64 and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # torch's grouped GEMM (the default from 5.25) has no float64
    if _experts_always_run(model):
        for layer in model.model.layers:
            _skip_idle_experts(layer.mlp, model.config)
    return model


def _experts_always_run(model) -> bool:
    """Whether this release's MoE block gives its routed experts a gradient even when every token
    of the call picks an identity expert (transformers >= 5.25 sends those picks to routed experts
    at weight 0; up to 5.24 the experts never see them)."""
    import copy

    probe = copy.deepcopy(model.model.layers[0].mlp)
    x = torch.zeros(2, model.config.hidden_size, dtype=probe.experts.gate_up_proj.dtype)
    x[:, 0] = -5.0  # dimension 0 as the embedding of ids < 64 writes it: every pick an identity expert
    probe(x[None]).sum().backward()
    return probe.experts.gate_up_proj.grad is not None


def _skip_idle_experts(moe, config) -> None:
    """The block's dispatch made to skip its experts when no token of the call picks a routed one,
    as token dispatchers that launch nothing for idle experts do (and transformers' LongCat up to
    5.24): the condition this module tests, on every release. Otherwise the release's own
    arithmetic: identity picks scale the input, routed picks go through the experts, identity
    picks reach the experts at weight 0 on the release's dummy indices."""
    n, zeros = config.n_routed_experts, config.zero_expert_num

    def forward(hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # [tokens, hidden]
        _, weights, picks = moe.router(x)  # [tokens, top_k] each
        identity = picks >= n
        out = x * weights.masked_fill(~identity, 0.0).sum(dim=-1, keepdim=True)
        if not bool(identity.all()):
            dummy = (picks - n) * n // zeros
            routed = moe.experts(x, torch.where(identity, dummy, picks), weights.masked_fill(identity, 0.0))
            out = routed + out.to(routed.dtype)
        return out.reshape(shape)

    moe.forward = forward


def _reference(path, batch):
    model = _load(path)
    out = model(**batch, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _unused_here(model) -> list[str]:
    return sorted(n for n, p in model.named_parameters() if p.requires_grad and p.grad is None and n.endswith(EXPERT_PARAMS))


def _sum_gradients_path(path: str, ulysses: int) -> dict:
    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.integrations.model_patch import patch
    from hf_longctx.distributed.loss import global_loss, sum_gradients

    mesh = worker_mesh(ulysses, 1)
    batch = moe_batch(mesh.sp)
    ref_loss, ref_grads = _reference(path, batch)
    model = patch(_load(path), mesh)
    out = model(**shard_batch(batch, mesh))
    out.loss.backward()
    unused = _unused_here(model)
    sum_gradients(model.parameters(), mesh)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    errs = compare(ref_loss, ref_grads, global_loss(out.loss, mesh), grads)
    errs["unused_here"] = unused
    return errs


def _fsdp_path(path: str, ulysses: int) -> dict:
    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.integrations.accelerate import fsdp_plan
    from hf_longctx.integrations.model_patch import patch
    from hf_longctx.distributed.loss import global_loss

    mesh = worker_mesh(ulysses, 1)
    batch = moe_batch(mesh.sp)
    ref_loss, ref_grads = _reference(path, batch)
    model = patch(_load(path), mesh)
    fsdp_plan(model, mesh, mixed_precision="fp32").apply(model)
    shard = shard_batch(batch, mesh)
    # The unsharded expert gradients exist only inside FSDP's backward: read the routing instead.
    unused = _routed_nowhere_here(model, shard)
    out = model(**shard)
    out.loss.backward()
    grads = {n: p.grad.full_tensor().detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    errs = compare(ref_loss, ref_grads, global_loss(out.loss, mesh), grads)
    errs["unused_here"] = unused
    return errs


def _routed_nowhere_here(model, shard) -> list[str]:
    """Layers whose routed experts get no token of this rank's shard (router outputs, no grad)."""
    seen = {}
    hooks = []
    n_routed = model.config.n_routed_experts
    for i, layer in enumerate(model.model.layers):

        def hook(module, args, output, i=i, n_routed=n_routed):
            seen[i] = bool((output[2] < n_routed).any())  # top-k indices below n_routed: a routed expert

        hooks.append(layer.mlp.router.register_forward_hook(hook))
    with torch.no_grad():
        model(**{k: v for k, v in shard.items() if k not in ("labels", "shift_labels")})
    for h in hooks:
        h.remove()
    return [f"model.layers.{i}.mlp.{p}" for i, used in sorted(seen.items()) if not used for p in EXPERT_PARAMS]


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return save_moe(tmp_path_factory.mktemp("moe"))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("path_kind", ["sum_gradients", "fsdp2"])
def test_moe_expert_without_tokens_on_a_rank_is_exact(pools, moe_path, world, path_kind):
    task = _sum_gradients_path if path_kind == "sum_gradients" else _fsdp_path
    results = pools.get(world).run(task, moe_path, world, timeout=300)
    # The precondition: the first half of the ranks route tokens to the routed experts, the
    # second half to the identity experts only (no gradient for the routed experts there).
    half = world // 2
    assert all(not r["unused_here"] for r in results[:half]), [r["unused_here"] for r in results]
    assert all(r["unused_here"] for r in results[half:]), [r["unused_here"] for r in results]
    for rank, errs in enumerate(results):
        assert "missing_grads" not in errs, f"rank {rank}: gradient set differs from the single process: {errs}"
        assert errs["loss"] <= LOSS_TOL and errs["grad"] <= GRAD_TOL, f"{path_kind} rank {rank}: {errs}"


def test_sum_gradients_parameter_without_grad_anywhere_stays_none(pools):
    """A trainable parameter no rank used keeps grad None (as in the unsharded model), and
    every rank still joins the same collectives."""
    results = pools.get(2).run(_unused_everywhere, timeout=120)
    assert results == [(True, 3.0)] * 2, results


def _unused_everywhere():
    import torch.distributed as dist

    from hf_longctx.distributed.loss import sum_gradients

    mesh = worker_mesh(2, 1)
    used, unused = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    (used * (dist.get_rank() + 1)).sum().backward()  # rank 0: grad 1, rank 1: grad 2 -> sum 3
    sum_gradients([unused, used], mesh)
    return unused.grad is None, float(used.grad[0])



# -- the Trainer (FSDP2 through LongContextTrainer) and the flexible step (run_flex_step) -----------
def _split_documents(n_docs: int, half: int, seed: int = 3) -> list[list[int]]:
    """Documents of `half` ids >= 64 (routed experts) then `half` ids < 64 (identity experts)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.cat([torch.randint(64, 128, (half,), generator=g), torch.randint(1, 64, (half,), generator=g)]).tolist()
            for _ in range(n_docs)]


def _trainer_run(path: str, ulysses: int | None, output_dir: str) -> dict:
    from datasets import Dataset

    from hf_longctx import LongContextTrainer, init_sequence_parallel, patch
    from tests.helpers.trainer_cases import history, training_args

    args = training_args(output_dir, max_steps=2)  # first: it adopts the process group
    mesh = worker_mesh(ulysses, 1) if ulysses else init_sequence_parallel()
    model = patch(_load(path), mesh)
    # One 16-token document per step: with Ulysses U the first U/2 ranks hold its ids >= 64, the rest only ids < 64.
    ds = Dataset.from_dict({"input_ids": _split_documents(2, 8)})
    trainer = LongContextTrainer(model=model, args=args, train_dataset=ds, mesh=mesh, max_tokens=16, tokens_per_step=16)
    unused = []
    if ulysses:  # the precondition, on the first step's document sharded as the trainer shards it
        from hf_longctx.data.sharding import shard_batch

        ids = torch.tensor(ds[0]["input_ids"])[None]  # [1, 16]
        batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(ids.shape[1])[None]}
        unused = _routed_nowhere_here(model, shard_batch(batch, mesh))
    trainer.train()
    return {"steps": history(trainer), "unused_here": unused}


@pytest.mark.parametrize("world", [2, 4])
def test_moe_trainer_step_with_unused_experts_on_a_rank(pools, moe_path, tmp_path, world):
    from tests.helpers.trainer_cases import assert_steps_close

    ref = _trainer_run(moe_path, None, str(tmp_path / "ref"))
    out = pools.get(world).run(_trainer_run, moe_path, world, str(tmp_path / "sp"), timeout=300)
    half = world // 2  # the precondition: the second half of the ranks route no token to the routed experts
    assert all(not r["unused_here"] for r in out[:half]) and all(r["unused_here"] for r in out[half:]), [
        r["unused_here"] for r in out]
    for rank, res in enumerate(out):
        assert_steps_close(res["steps"], ref["steps"], LOSS_TOL, f"MoE trainer rank {rank}")


def _flex_run(path: str, fsdp: bool, world: int) -> dict:
    from transformers import DataCollatorWithFlattening

    from hf_longctx.flex.plan import FlexGroup, FlexPlan
    from hf_longctx.flex.step import flex_microbatches, run_flex_step
    from hf_longctx.integrations.accelerate import fsdp_plan
    from hf_longctx.integrations.model_patch import patch
    from tests.helpers.pool import worker_bank

    high, low = _split_documents(1, 8)[0][:8], _split_documents(1, 8)[0][8:]
    docs = [high] * (world // 2) + [low] * (world // 2)  # rank r runs docs[r]: the first half ids >= 64, the rest < 64
    # float64: with 8-token documents the MLA query projection's gradient is ill-conditioned, so
    # two fp32 single-process references (packed vs one document at a time) already differ by
    # 2e-4; in float64 the comparison measures the step, not fp32 re-association.
    ref_model = _load(path, torch.float64)
    batch = DataCollatorWithFlattening(return_position_ids=True, return_tensors="pt")([{"input_ids": d} for d in docs])
    ref = ref_model(**batch, use_cache=False)
    ref.loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in ref_model.named_parameters() if p.grad is not None}

    bank = worker_bank(heads=moe_config().num_attention_heads, ranks_per_node=world)
    model = patch(_load(path, torch.float64), bank)
    if fsdp:
        fsdp_plan(model, bank.world, mixed_precision="fp32").apply(model)
    plan = FlexPlan(slots=(tuple(FlexGroup(1, r, (r,)) for r in range(world)),), lengths=(8,) * world, world_size=world,
                    max_tokens_per_rank=16, shapes=bank.shapes, equal_calls=True)
    shard = next(iter(flex_microbatches(plan, bank, docs)))  # this rank's one slot
    unused = _routed_nowhere_here(model, shard)
    loss = run_flex_step(model, bank, plan, docs)
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
             for n, p in model.named_parameters() if p.grad is not None}
    errs = compare(ref.loss.detach(), ref_grads, loss, grads)
    errs["unused_here"] = unused
    return errs


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("fsdp", [False, True])
def test_moe_flexible_step_with_unused_experts_on_a_rank(pools, moe_path, fsdp, world):
    results = pools.get(world).run(_flex_run, moe_path, fsdp, world, timeout=300)
    half = world // 2
    assert all(not r["unused_here"] for r in results[:half]) and all(r["unused_here"] for r in results[half:]), [
        r["unused_here"] for r in results]
    for rank, errs in enumerate(results):
        assert "missing_grads" not in errs, f"rank {rank}: {errs}"
        assert errs["loss"] <= LOSS_TOL and errs["grad"] <= GRAD_TOL, f"flex fsdp={fsdp} rank {rank}: {errs}"
