"""Patched HF models under SP vs the same model unpatched in one process: loss and gradients.

For every core family (Llama, Mistral, Qwen2, Qwen3, Phi3, Gemma2 with
softcaps and sliding windows, GPT-2, GPT-NeoX with partial rotary, GPTBigCode with MQA) and
the meshes (ulysses, ring) = (2, 2), (4, 1), (1, 4) on 4 gloo ranks: the SP group's summed
loss and summed parameter gradients equal the single-process model's on the same packed
batch (documents of odd lengths, one spanning several shards, padding present). Models are
built from tiny configs, saved, and loaded back with `from_pretrained` (the real path); fp32,
train() mode, every dropout 0.

Tolerances (relative, max|a-b| / max|b|): loss 1e-5 -- fp32 logits of a 2-layer model carry
~1e-7 relative rounding and the SP loss differs only in summation order (per-rank partial
sums); gradients 1e-4 -- a parameter gradient sums ~50 token contributions whose order
differs between the ring merge and one dense softmax, so a few 1e-6 are expected; a wrong
mask, a lost target or a wrong scale gives errors of order 1e-2 or more.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.pool import worker_mesh
from tests.helpers.families import compare, load, packed_batch, reference, rel, save_family, sp_loss_and_grads

LOSS_TOL = 1e-5
GRAD_TOL = 1e-4
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gpt2", "gpt_neox", "gpt_bigcode"]


def _families_on_mesh(ulysses: int, ring: int, paths: dict) -> dict:
    from hf_longctx.integrations.model_patch import patch

    mesh = worker_mesh(ulysses, ring)
    batch = packed_batch()
    out = {}
    for family, path in paths.items():
        ref_loss, ref_grads = reference(load(path), batch)
        model = patch(load(path), mesh)
        loss, local_loss, grads = sp_loss_and_grads(model, batch, mesh)
        out[family] = compare(ref_loss, ref_grads, loss, grads)
        out[family]["local_share"] = local_loss.item() / ref_loss.item()  # a rank's share, not the whole loss
    return out


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {family: save_family(family, root) for family in FAMILIES}


@pytest.mark.parametrize("ulysses,ring", [(2, 2), (4, 1), (1, 4)])
def test_every_family_matches_single_process(pools, model_paths, ulysses, ring):
    results = pools.get(4).run(_families_on_mesh, ulysses, ring, model_paths, timeout=300)
    for rank, per_family in enumerate(results):
        for family, errs in per_family.items():
            assert "missing_grads" not in errs, f"{family} rank {rank}: gradient set differs"
            assert errs["loss"] <= LOSS_TOL, f"{family} mesh ({ulysses},{ring}) rank {rank}: loss rel err {errs}"
            assert errs["grad"] <= GRAD_TOL, f"{family} mesh ({ulysses},{ring}) rank {rank}: grad rel err {errs}"
    # each rank's own loss is a share of the total (summed, not averaged); the shares add up
    for family in FAMILIES:
        shares = [r[family]["local_share"] for r in results]
        assert abs(sum(shares) - 1.0) <= LOSS_TOL, f"{family}: shares {shares} do not sum to 1"
        assert max(shares) < 0.9, f"{family}: one rank holds the whole loss {shares}"


# ---- PEFT LoRA and optimizer steps --------------------------------------------------------


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False)
    return get_peft_model(model, cfg)


def _peft_and_sgd(path: str) -> dict:
    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.integrations.model_patch import patch
    from hf_longctx.distributed.loss import sum_gradients

    mesh = worker_mesh(2, 2)
    batch = packed_batch(seed=3)
    errs = {}
    # LoRA, patched AFTER get_peft_model and BEFORE it: adapter gradients must match.
    ref = _lora(load(path))
    ref_loss, ref_grads = reference(ref, batch)
    for order in ("after", "before"):
        model = patch(_lora(load(path)), mesh) if order == "after" else _lora(patch(load(path), mesh))
        loss, _, grads = sp_loss_and_grads(model, batch, mesh)
        e = compare(ref_loss, ref_grads, loss, grads)
        e["adapters"] = float(sum("lora_" in n for n in grads))
        errs[f"lora_{order}"] = e
    # Three SGD steps on three different packed batches, with SP and without.
    ref, model = load(path), patch(load(path), mesh)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(3):
        b = packed_batch(docs=[9, 17 + step, 6], seed=10 + step)
        opt_ref.zero_grad()
        ref(**b, use_cache=False).loss.backward()
        opt_ref.step()
        opt.zero_grad()
        model(**shard_batch(b, mesh)).loss.backward()
        sum_gradients(model.parameters(), mesh)
        opt.step()
    # compare the UPDATES (parameters minus their initial values): comparing the parameters
    # themselves would hide update errors behind the size of the weights
    start = dict(load(path).named_parameters())
    ref_params = dict(ref.named_parameters())
    errs["sgd"] = {"update": max(rel(p - start[n], ref_params[n] - start[n]) for n, p in model.named_parameters())}
    errs["sgd"]["moved"] = min((ref_params[n] - start[n]).abs().max().item() for n in start)
    return errs


def test_lora_adapters_and_three_sgd_steps(pools, model_paths):
    for rank, errs in enumerate(pools.get(4).run(_peft_and_sgd, model_paths["llama"], timeout=300)):
        for order in ("after", "before"):
            e = errs[f"lora_{order}"]
            assert e["adapters"] == 2 * 4 * 2, f"rank {rank}: LoRA adapters with gradients {e}"  # A and B x 4 modules x 2 layers
            assert "missing_grads" not in e and e["loss"] <= LOSS_TOL and e["grad"] <= GRAD_TOL, f"rank {rank} {order}: {e}"
        # the summed update of 3 steps carries the gradient errors of 3 steps: same tolerance
        assert errs["sgd"]["update"] <= GRAD_TOL, f"rank {rank}: {errs['sgd']}"
        assert errs["sgd"]["moved"] > 0, f"rank {rank}: some parameter never moved {errs['sgd']}"
