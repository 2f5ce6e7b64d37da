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
