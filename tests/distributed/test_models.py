"""Patched HF models under SP vs the same model unpatched in one process: loss and gradients.

For every family of the integration issue (Llama, Mistral, Qwen2, Qwen3, Phi3, Gemma2 with
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

LOSS_TOL = 1e-5
GRAD_TOL = 1e-4
DOCS = [7, 23, 5, 14]  # odd lengths; 23 spans several shards; total 49 forces padding on every mesh
WINDOW = 8  # small sliding window, so windows cross shard boundaries
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gpt2", "gpt_neox", "gpt_bigcode"]


def family_config(family: str):
    """A tiny config of `family` with every dropout 0 (exactness needs it)."""
    import transformers as tf

    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    if family == "llama":
        return tf.LlamaConfig(**common, num_key_value_heads=2)
    if family == "mistral":
        return tf.MistralConfig(**common, num_key_value_heads=2, sliding_window=WINDOW)
    if family == "qwen2":  # layer 0 full attention, layer 1 sliding
        return tf.Qwen2Config(**common, num_key_value_heads=2, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if family == "qwen3":
        return tf.Qwen3Config(**common, num_key_value_heads=2, head_dim=8)
    if family == "phi3":
        return tf.Phi3Config(**common, num_key_value_heads=2, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0)
    if family == "gemma2":  # layer 0 sliding, layer 1 full; both softcaps on
        return tf.Gemma2Config(
            **common, num_key_value_heads=2, head_dim=8, sliding_window=WINDOW,
            attn_logit_softcapping=5.0, final_logit_softcapping=3.0, query_pre_attn_scalar=8,
        )
    gpt = dict(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=128, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    if family == "gpt2":
        return tf.GPT2Config(**gpt)
    if family == "gpt_bigcode":  # multi-query: one KV head
        return tf.GPTBigCodeConfig(**gpt, multi_query=True)
    if family == "gpt_neox":  # partial rotary
        return tf.GPTNeoXConfig(**common, rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0)
    raise KeyError(family)


def save_family(family: str, root) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(family))
    path = f"{root}/{family}"
    model.save_pretrained(path)
    return path


def load(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.train()


def packed_batch(docs=DOCS, seed: int = 0, vocab: int = 128) -> dict:
    """A batch as DataCollatorWithFlattening(return_position_ids=True) makes it."""
    from transformers import DataCollatorWithFlattening

    g = torch.Generator().manual_seed(seed)
    features = [{"input_ids": torch.randint(1, vocab, (n,), generator=g).tolist()} for n in docs]
    return DataCollatorWithFlattening(return_position_ids=True, return_tensors="pt")(features)


def reference(model, batch: dict):
    """Single-process loss and gradients of the unpatched model (use_cache=False: HF's
    cache path would disable its packed-document mask)."""
    model.zero_grad(set_to_none=True)
    out = model(**batch, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def sp_loss_and_grads(model, batch: dict, mesh):
    """Patched forward/backward on this rank's shard; loss and gradients SUMMED over the world."""
    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.loss import global_loss, sum_gradients

    model.zero_grad(set_to_none=True)
    out = model(**shard_batch(batch, mesh))
    out.loss.backward()
    sum_gradients(model.parameters(), mesh)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return global_loss(out.loss, mesh), out.loss.detach(), grads


def compare(ref_loss, ref_grads, loss, grads) -> dict:
    errs = {"loss": rel(loss, ref_loss)}
    if set(grads) != set(ref_grads):
        errs["missing_grads"] = float(len(set(ref_grads) ^ set(grads)))
    errs["grad"] = max(rel(grads[n], ref_grads[n]) for n in ref_grads)
    return errs


def _families_on_mesh(ulysses: int, ring: int, paths: dict) -> dict:
    from hf_longctx.integrations.transformers import patch

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
    from hf_longctx.integrations.transformers import patch
    from hf_longctx.loss import sum_gradients

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
