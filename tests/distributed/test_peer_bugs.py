"""One test per bug class that breaks sequence-parallel HF integrations in other projects.

Each test is written to FAIL on its bug, and where the bug can be emulated the test also
shows that the emulation is caught (so the check cannot pass vacuously):
1. labels shifted after sharding (one target lost at every shard boundary);
2. a non-differentiable loss all-reduce combined with DDP averaging (wrong gradient scale);
3. SP ranks fed different samples;
4. packed documents pushed through a non-varlen ring (documents attend to each other);
5. RoPE computed from local positions;
6. HF's mask built at the local shard length;
7. use_cache=True in training silently disabling packed-document masking;
8. breakage on a transformers release (attention or metadata silently bypassed).
The distributed checks run in ONE pool task on 4 gloo ranks (a module fixture) to amortise
start-up; each test asserts its own part. Tolerances as in test_models.py: fp32 loss/logits
rel 1e-5; an emulated bug must be off by > 1e-3 (it is off by 1e-2 .. 1e0 in practice).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_longctx.data.sharding import SP_METADATA_KEY, shard_batch
from hf_longctx.distributed.gather import gather_sequence
from hf_longctx.integrations.model_patch import patch, unpatch
from hf_longctx.distributed.loss import global_loss, sum_gradients
from tests.helpers.families import load, packed_batch, reference, rel, save_family
from tests.helpers.pool import worker_mesh

TOL = 1e-5
BUG = 1e-3


def _labels_part(mesh) -> dict:
    batch = packed_batch()
    shard = shard_batch(batch, mesh)
    info = shard[SP_METADATA_KEY]
    ours = gather_sequence(shard["shift_labels"][..., None], shard, mesh)[..., 0]  # [1, S]
    expected = torch.cat([batch["labels"][:, 1:], torch.full((1, 1), -100)], 1)  # HF's own shift on the full row
    # the bug: shard the unshifted labels, then shift each shard locally
    padded = torch.full((1, info.padded_length), -100)
    padded[:, info.source_positions()] = batch["labels"]
    local = padded[:, mesh.local_indices(info.cu_seqlens)]
    buggy = torch.cat([local[:, 1:], torch.full((1, 1), -100)], 1)
    counts = torch.tensor([int((shard["shift_labels"] != -100).sum()), int((buggy != -100).sum())])
    dist.all_reduce(counts, group=mesh.sp_group)
    return {"equal": torch.equal(ours, expected), "expected": int((expected != -100).sum()),
            "ours": int(counts[0]), "buggy": int(counts[1]), "num_items": shard["num_items_in_batch"]}


def _scale_part(mesh, path) -> dict:
    batch = packed_batch()
    ref_loss, ref_grads = reference(load(path), batch)
    model = patch(load(path), mesh)
    out = model(**shard_batch(batch, mesh))
    out.loss.backward()
    logged = global_loss(out.loss, mesh)
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    sum_gradients(model.parameters(), mesh)
    summed = max(rel(p.grad, ref_grads[n]) for n, p in model.named_parameters())
    averaged = max(rel(p.grad / mesh.world_size, ref_grads[n]) for n, p in model.named_parameters())
    return {"summed": summed, "averaged": averaged, "logged": rel(logged, ref_loss), "logged_grad": logged.requires_grad,
            "local_is_share": rel(out.loss, ref_loss) > BUG, "local_grad_is_share": max(rel(local[n], ref_grads[n]) for n in local) > BUG}


def _samples_part(mesh, path) -> dict:
    model = patch(load(path), mesh)
    good = shard_batch(packed_batch(seed=100 + mesh.dp_rank), mesh)  # seeded by DP rank: SP ranks agree
    model(**good)
    bad = shard_batch(packed_batch(seed=200 + mesh.rank), mesh)  # seeded by global rank: same shapes, other tokens
    try:
        model(**bad)
        error = ""
    except ValueError as e:
        error = str(e)
    t = torch.ones(1)
    dist.all_reduce(t)  # every rank reaches the next collective: the refusal did not hang anyone
    return {"error": error, "fingerprint": good[SP_METADATA_KEY].fingerprint, "after": t.item()}


def _documents_part(mesh, path) -> dict:
    batch = packed_batch()
    model = patch(load(path), mesh)
    other = dict(batch)
    other["input_ids"] = batch["input_ids"].clone()
    other["input_ids"][:, :7] = (other["input_ids"][:, :7] + 11) % 128  # change document 0 only
    shard, shard2 = shard_batch(batch, mesh), shard_batch(other, mesh)
    logits = gather_sequence(model(**shard).logits, shard, mesh)
    logits2 = gather_sequence(model(**shard2).logits, shard2, mesh)
    ref = load(path).train()
    ref_logits = ref(**batch, use_cache=False).logits
    one_doc = {**batch, "position_ids": torch.arange(batch["input_ids"].shape[1])[None]}  # no document boundaries
    return {"later_docs_unchanged": rel(logits2[:, 7:], logits[:, 7:]), "doc0_changed": rel(logits2[:, :7], logits[:, :7]),
            "vs_ref": rel(logits, ref_logits), "no_mask_vs_ref": rel(ref(**one_doc, use_cache=False).logits, ref_logits)}


def _rope_part(mesh, path) -> dict:
    batch = packed_batch()
    model = patch(load(path), mesh)
    shard = shard_batch(batch, mesh)
    positions = gather_sequence(shard["position_ids"][..., None], shard, mesh)[..., 0]
    ref_logits = load(path).train()(**batch, use_cache=False).logits
    ours = gather_sequence(model(**shard).logits, shard, mesh)
    local = {**shard, "position_ids": torch.arange(shard["input_ids"].shape[1])[None]}  # the bug: local positions
    buggy = gather_sequence(model(**local).logits, shard, mesh)
    return {"positions": torch.equal(positions, batch["position_ids"]), "max_local_pos": int(shard["position_ids"].max()),
            "s_local": shard["input_ids"].shape[1], "ours": rel(ours, ref_logits), "buggy": rel(buggy, ref_logits)}


def _mask_part(mesh, path) -> dict:
    batch = packed_batch()
    model = patch(load(path), mesh)
    shard = shard_batch(batch, mesh)
    ref_logits = load(path).train()(**batch, use_cache=False).logits
    plain = gather_sequence(model(**shard).logits, shard, mesh)
    ones = torch.ones_like(shard["input_ids"])  # what a peer passes: a mask of the LOCAL length
    with_mask = gather_sequence(model(**shard, attention_mask=ones).logits, shard, mesh)
    zeros = ones.clone()
    zeros[:, -1] = 0
    try:
        model(**shard, attention_mask=zeros)
        error = ""
    except ValueError as e:
        error = str(e)
    return {"plain": rel(plain, ref_logits), "with_mask": rel(with_mask, ref_logits), "error": error}


def _all_parts(paths: dict) -> dict:
    return {
        "labels": _labels_part(worker_mesh(1, 4)),
        "scale": _scale_part(worker_mesh(2, 2), paths["llama"]),
        "samples": _samples_part(worker_mesh(1, 2), paths["llama"]),
        "documents": _documents_part(worker_mesh(1, 4), paths["llama"]),
        "rope": _rope_part(worker_mesh(2, 2), paths["llama"]),
        "mask": _mask_part(worker_mesh(2, 2), paths["mistral"]),
    }


@pytest.fixture(scope="module")
def results(pools, tmp_path_factory):
    root = tmp_path_factory.mktemp("peer_models")
    paths = {f: save_family(f, root) for f in ("llama", "mistral")}
    return pools.get(4).run(_all_parts, paths, timeout=300)


def test_1_labels_shifted_on_full_sequence_not_per_shard(results):
    for r in results:
        part = r["labels"]
        assert part["equal"], "gathered shift_labels differ from HF's shift of the full row"
        assert part["ours"] == part["expected"] == part["num_items"], part
        assert part["buggy"] < part["expected"], f"emulated bug lost no target: {part}"  # the check is sensitive


def test_2_gradients_summed_and_loss_reduction_detached(results):
    for r in results:
        part = r["scale"]
        assert part["summed"] <= 1e-4 and part["logged"] <= TOL, part
        assert part["averaged"] > 0.5, part  # DDP-style averaging would be off by the world size
        assert not part["logged_grad"], "global_loss must be detached"
        assert part["local_is_share"] and part["local_grad_is_share"], "rank loss/grad already reduced in the graph"


def test_3_sp_ranks_fed_different_samples_fail_loudly(results):
    for r in results:
        part = r["samples"]
        assert "DIFFERENT batches" in part["error"] and part["after"] == 4.0, part
    fingerprints = [r["samples"]["fingerprint"] for r in results]
    assert fingerprints[0] == fingerprints[1] and fingerprints[2] == fingerprints[3]  # SP pairs agree
    assert fingerprints[0] != fingerprints[2]  # DP groups train on different samples


def test_4_packed_documents_do_not_attend_to_each_other(results):
    for r in results:
        part = r["documents"]
        # later documents must not move at all when document 0 changes; 1e-6 covers only the
        # rounding of merging fully masked ring blocks (an attending bug moves them by ~1e-1)
        assert part["later_docs_unchanged"] <= 1e-6 and part["doc0_changed"] > BUG, part
        assert part["vs_ref"] <= TOL and part["no_mask_vs_ref"] > BUG, part


def test_5_rope_uses_global_positions(results):
    for r in results:
        part = r["rope"]
        assert part["positions"] and part["ours"] <= TOL and part["buggy"] > BUG, part
    assert max(r["rope"]["max_local_pos"] for r in results) >= results[0]["rope"]["s_local"]


def test_6_hf_local_length_mask_is_never_used(results):
    for r in results:
        part = r["mask"]  # Mistral, sliding window 8 crossing shard boundaries
        assert part["plain"] <= TOL and part["with_mask"] <= TOL, part
        assert "attention_mask with padding zeros" in part["error"], part


# ---- single-process bug classes -----------------------------------------------------------


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return save_family("llama", tmp_path_factory.mktemp("llama1"))


def test_7_use_cache_true_cannot_disable_document_masking(llama_path):
    from hf_longctx import init_sequence_parallel

    mesh = init_sequence_parallel()
    batch = packed_batch()
    ref = load(llama_path)
    masked = ref(**batch, use_cache=False).loss
    assert rel(ref(**batch, use_cache=True).loss, masked) > BUG  # HF itself: the cache path drops the packed mask
    model = patch(load(llama_path), mesh)
    assert model.config.use_cache  # the config still asks for a cache; the patch overrides it per forward
    shard = shard_batch(batch, mesh)
    out = model(**shard)
    assert out.past_key_values is None and rel(out.loss, masked) <= TOL
    with pytest.raises(ValueError, match="use_cache=False"):
        model(**shard, use_cache=True)
    unpatch(model)


def test_8_release_breakage_is_detected_not_silent(llama_path, monkeypatch):
    from hf_longctx import init_sequence_parallel

    mesh = init_sequence_parallel()
    shard = shard_batch(packed_batch(), mesh)
    model = patch(load(llama_path), mesh)
    # a release that stops routing one layer through the interface
    attn = model.model.layers[1].self_attn
    monkeypatch.setattr(attn, "forward", lambda hidden_states, **kw: (torch.zeros_like(hidden_states), None))
    with pytest.raises(RuntimeError, match=r"made 1 sequence-parallel attention calls, but the dry run at patch\(\) made 2"):
        model(**shard)
    monkeypatch.undo()
    # a release that stops forwarding model kwargs to the attention function
    layer = model.model.layers[0]
    original = layer.forward
    monkeypatch.setattr(layer, "forward", lambda *a, **kw: original(*a, **{k: v for k, v in kw.items() if k != SP_METADATA_KEY}))
    with pytest.raises(ValueError, match="no 'sp_batch' metadata reached the attention"):
        model(**shard)
    monkeypatch.undo()
    unpatch(model)
    # a release that changes the registries: refused at patch() with the supported range
    from transformers.modeling_utils import AttentionInterface

    fresh = load(llama_path)
    monkeypatch.setattr(AttentionInterface, "_global_mapping", None)
    with pytest.raises(RuntimeError, match=">=5.23,<6"):
        patch(fresh, mesh)
