"""Tiny Hugging Face models of every supported family, and the single-process reference.

`family_config` builds a 2-layer config of one family (every dropout 0, exactness needs
it), `save_family` saves it with `save_pretrained` so tests load it back the way users do
(`load`: `from_pretrained`, fp32, train mode). `packed_batch` is what
`DataCollatorWithFlattening(return_position_ids=True)` makes; `reference` runs the unpatched
model on it in one process; `sp_loss_and_grads` runs the patched one on this rank's shard and
sums loss and gradients over the SP group; `compare` / `rel` give the relative errors
(max|a-b| / max|b|) the tests hold to their tolerances.
"""

from __future__ import annotations

import torch

DOCS = [7, 23, 5, 14]  # odd lengths; 23 spans several shards; total 49 forces padding on every mesh
WINDOW = 8  # small sliding window, so windows cross shard boundaries


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
    from hf_longctx.distributed.loss import global_loss, sum_gradients

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
