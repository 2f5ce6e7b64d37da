"""`torch.compile` of a patched model: the layers compile around our attention, exactly.

The registered attention function, the mask function and the model-level hooks are behind
`torch.compiler.disable` (`integrations/attention.py`, `integrations/model_patch.py`): they
run collectives and per-batch Python plans. Dynamo compiles the rest of every layer
(projections, RoPE, norms, MLP) and calls the attention eagerly in between, so a new
document layout of the same length reuses the graphs (no retrace per batch). Compared on 2
gloo ranks with the same model run eagerly: fp32, loss 1e-5 and gradients 1e-4 relative
(the compiled graphs may reorder float sums). The `aot_eager` backend traces through
AOTAutograd as inductor does, without generating C++ (inductor itself: the same result,
~10x the compile time on CPU).

Through the Trainer: `TrainingArguments(torch_compile=True)` makes Accelerate's prepare
compile the patched, FSDP2-sharded model (the step runs through the compiled module); one SGD
step (lr 1: each shard's update is minus its clipped gradient) on 2 gloo ranks gives the eager
run's logged loss and grad_norm and every shard's update, at the tolerances above.

With the memory presets it stays exact, but compiles little: Dynamo cannot trace the
offloaded checkpoint of a layer (a side effect inside `torch.utils.checkpoint`: the chain of
parked inputs), so it runs those layers eagerly, and the chunked LM-head loss
(`integrations/memory.py`) specialises on each batch's valid-token count.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.pool import worker_mesh

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
# One packed row of 64 tokens each, four documents: on torch 2.11 Dynamo guards on the number of
# documents of the batch metadata (a frozen dataclass it unpacks), so a new count compiles once
# more (up to torch._dynamo.config.cache_size_limit); torch 2.13 guards on neither.
LAYOUTS = ([20, 12, 24, 8], [8, 24, 12, 20], [16, 16, 16, 16])


def _batch(docs, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 96, (1, sum(docs)), generator=g)
    pos = torch.cat([torch.arange(n) for n in docs])[None]  # [1, S] per-document positions
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}


def _compiled_vs_eager(family: str, ulysses: int, ring: int, options: dict) -> dict:
    import torch._dynamo
    from torch._dynamo.utils import counters

    from benchmarks.hot_path import _model
    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.integrations.model_patch import patch

    mesh = worker_mesh(ulysses, ring, 2 if options.get("memory") == "max" else 1)
    torch._dynamo.reset()
    counters.clear()
    models = []
    for _ in range(2):
        m = _model(family, 2).float()
        models.append(patch(m, mesh, **options).train())
    eager, compiled = models[0], torch.compile(models[1], backend="aot_eager")
    worst = {"loss": 0.0, "grad": 0.0}
    graphs = []
    for seed, docs in enumerate(LAYOUTS):
        shard = shard_batch(_batch(docs, seed), mesh)
        losses = []
        for m, run in ((eager, eager), (models[1], compiled)):
            m.zero_grad(set_to_none=True)
            loss = run(**shard).loss
            loss.backward()
            losses.append(loss.detach())
        worst["loss"] = max(worst["loss"], ((losses[1] - losses[0]).abs() / losses[0].abs()).item())
        for (name, p), q in zip(eager.named_parameters(), models[1].parameters()):
            if p.grad is not None:
                scale = p.grad.abs().max().clamp_min(1e-30)
                worst["grad"] = max(worst["grad"], ((q.grad - p.grad).abs().max() / scale).item())
        graphs.append(counters["stats"]["unique_graphs"])
    return dict(worst, graphs=graphs, captured=counters["stats"]["calls_captured"])


@pytest.mark.parametrize("family,ulysses,ring,options", [
    ("llama", 2, 1, {}), ("llama", 1, 2, {}), ("lfm2", 2, 1, {}), ("llama", 2, 1, {"memory": "max"}),
], ids=["llama-U2", "llama-R2", "lfm2-U2", "llama-U2-memory=max"])
def test_compiled_patched_model_is_exact(pools, family, ulysses, ring, options):
    for rank, r in enumerate(pools.get(ulysses * ring).run(_compiled_vs_eager, family, ulysses, ring, options)):
        assert r["loss"] <= LOSS_TOL and r["grad"] <= GRAD_TOL, (rank, r)
        assert r["captured"] > 0, (rank, r)  # something was compiled
        if not options:  # a new document layout reuses the graphs
            assert r["graphs"][1] == r["graphs"][2], (rank, r)


def _trainer_step(path: str, output_dir: str, compile_: bool) -> dict:
    """One LongContextTrainer SGD step (lr 1: the update is minus the clipped gradient) on U2,
    FSDP2 over both ranks, compiled by the Trainer or eager: logged loss / grad_norm and the
    update of every parameter shard."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    from hf_longctx import LongContextTrainer, patch
    from tests.helpers.trainer_cases import history, make_dataset, training_args

    kw = dict(torch_compile=True, torch_compile_backend="aot_eager") if compile_ else {}
    args = training_args(output_dir, max_steps=1, warmup_steps=0, optim="sgd", learning_rate=1.0, **kw)
    mesh = worker_mesh(2, 1)
    torch._dynamo.reset()
    counters.clear()
    model = patch(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), mesh)
    trainer = LongContextTrainer(model=model, args=args, train_dataset=make_dataset(12, masked=True), mesh=mesh,
                                 max_tokens=48, tokens_per_step=100)
    before = {n: p.to_local().detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    update = {n: p.to_local().detach() - before[n] for n, p in trainer.model.named_parameters()}
    return {"steps": history(trainer), "wrapped": type(trainer.model_wrapped).__name__, "update": update,
            "captured": counters["stats"]["calls_captured"]}


def test_trainer_torch_compile_equals_eager(pools, tmp_path):
    from hf_longctx._compat import trainer_takes_sharded_models
    from tests.helpers.families import save_family

    if not trainer_takes_sharded_models():  # transformers 5.17: the trainer refuses 2 ranks
        pytest.skip("this transformers release's Trainer would wrap the FSDP2 model in DDP: the trainer refuses 2 ranks")

    path = save_family("llama", tmp_path)
    pool = pools.get(2)
    eager = pool.run(_trainer_step, path, str(tmp_path / "eager"), False, timeout=300)
    compiled = pool.run(_trainer_step, path, str(tmp_path / "compiled"), True, timeout=600)
    for rank, (e, c) in enumerate(zip(eager, compiled)):
        assert c["wrapped"] == "OptimizedModule" and c["captured"] > 0, (rank, c["wrapped"], c["captured"])
        assert e["wrapped"] != "OptimizedModule" and len(c["steps"]) == len(e["steps"]) == 1, (rank, e["steps"])
        (lc, gc), (le, ge) = c["steps"][0], e["steps"][0]
        assert abs(lc - le) <= LOSS_TOL * abs(le) and abs(gc - ge) <= GRAD_TOL * abs(ge), (rank, c["steps"], e["steps"])
        assert max(u.abs().max().item() for u in e["update"].values()) > 1e-3  # the step moved the shards
        for name, want in e["update"].items():
            torch.testing.assert_close(c["update"][name], want, rtol=GRAD_TOL, atol=GRAD_TOL * want.abs().max().item(), msg=name)
