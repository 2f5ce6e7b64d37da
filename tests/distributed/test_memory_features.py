"""Every memory feature on (FPDT chunks + K/V offload, chunked MLP, chunked loss, offloaded
checkpointing) on a patched tiny Llama and GPT-2: loss and gradients vs a single-process reference.

The reference is independent of hf_longctx: the unpatched model in float64 with HF's eager
attention, run on every document separately (positions from 0), token losses summed and
divided by the number of valid targets. The SP ranks' losses and SUMMED gradients must equal
it (DESIGN invariant 6). Tolerances: loss rel err <= 1e-5 -- the fp32 model
over ~100 tokens and 2 layers rounds at ~1e-7 relative, while a dropped chunk, a wrong label
shift or a wrong divisor moves the loss by >= 1e-2; gradients max|a-b|/max|b| <= 1e-4 per
parameter -- summed over ranks and chunks in fp32, ~1e-6 expected.
Single-process checks of the head interception: without labels the patched model returns
the same logits as before; with labels it equals HF's own loss (Gemma2 softcapping included);
the undo restores the module dicts and state_dict keys exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from transformers import Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from hf_longctx import init_sequence_parallel
from hf_longctx.data.sharding import shard_batch
from hf_longctx.config import PatchOptions
from hf_longctx.integrations.memory import apply_memory_options
from hf_longctx.model_walk import decoder_layers
from hf_longctx.integrations.model_patch import patch, unpatch
from tests.helpers.pool import worker_mesh
from tests.helpers.reference import rel_err

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
DOCS = [13, 29, 7, 31]  # uneven packed documents; shard_batch pads to the layout multiple


def _model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    if family == "llama":
        cfg = LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=96, max_position_embeddings=128, attn_implementation="eager",
        )
        return LlamaForCausalLM(cfg)
    if family == "gpt2":
        cfg = GPT2Config(
            n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, attn_implementation="eager",
        )
        return GPT2LMHeadModel(cfg)
    cfg = Gemma2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=96, max_position_embeddings=128, final_logit_softcapping=3.0, attn_implementation="eager",
    )
    return Gemma2ForCausalLM(cfg)


def _packed(vocab: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, sum(DOCS)), generator=g)
    pos = torch.cat([torch.arange(n) for n in DOCS])[None]  # [1, S] per-document positions
    return ids, pos


def _reference(model, ids):
    """float64 loss and gradients, one document at a time with HF's own attention."""
    ref = copy.deepcopy(model).double()
    total, n_valid, start = 0.0, 0, 0
    for n in DOCS:
        doc = ids[:, start : start + n]
        logits = ref(input_ids=doc, use_cache=False).logits[0]  # [n, V]
        total = total + torch.nn.functional.cross_entropy(logits[:-1], doc[0, 1:], reduction="sum")
        n_valid += n - 1
        start += n
    loss = total / n_valid
    loss.backward()
    return loss.item(), {k: p.grad for k, p in ref.named_parameters()}


def _distributed_case(family: str, ulysses: int, chunks: int):
    mesh = worker_mesh(ulysses, 1, chunks)
    model = _model(family)
    ids, pos = _packed(model.config.vocab_size)
    ref_loss, ref_grads = _reference(model, ids)
    keys = list(model.state_dict())

    patch(model, mesh, kv_offload=True, mlp_chunks=2 * chunks, loss_chunks=3, checkpoint=True)
    model.train()
    shard = shard_batch({"input_ids": ids, "labels": ids.clone(), "position_ids": pos}, mesh)
    out = model(**shard)
    assert out.logits is None
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=mesh.sp_group)  # the SP ranks' losses sum to the global mean loss
    errs = {"loss": rel_err(loss, torch.tensor(ref_loss, dtype=torch.float64))}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=mesh.sp_group)  # gradients are SUMMED over ranks, never averaged
        errs[name] = rel_err(g, ref_grads[name])
    unpatch(model)
    errs["restored"] = float(list(model.state_dict()) != keys or "forward" in model.__dict__)
    return errs


@pytest.mark.parametrize("family,world,ulysses,chunks", [("llama", 2, 2, 2), ("gpt2", 2, 2, 4), ("llama", 4, 4, 2)])
def test_patched_model_matches_reference(pools, family, world, ulysses, chunks):
    for rank, errs in enumerate(pools.get(world).run(_distributed_case, family, ulysses, chunks)):
        assert errs.pop("restored") == 0.0, f"rank {rank}: unpatch did not restore the model"
        assert errs.pop("loss") <= LOSS_TOL, f"rank {rank}: loss rel err"
        bad = {k: f"{e:.1e}" for k, e in errs.items() if e > GRAD_TOL}
        assert not bad, f"rank {rank} {family}: gradient rel errs above {GRAD_TOL}: {bad}"


# ---- single process: the head interception and the undo ----------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_chunked_loss_equals_hf_loss_and_undo_is_exact(family):
    model = _model(family)
    mesh = init_sequence_parallel(1, 1, 2)
    ids, _ = _packed(model.config.vocab_size)
    ids = ids[:, :40]
    before = {n: dict(m.__dict__) for n, m in model.named_modules()}
    keys = list(model.state_dict())
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    ref = model(input_ids=ids, labels=ids, use_cache=False, num_items_in_batch=30).loss  # HF: sum / 30
    (ref_grad,) = torch.autograd.grad(ref, model.get_output_embeddings().weight)

    undo = apply_memory_options(model, mesh, PatchOptions(mlp_chunks=3, loss_chunks=4, checkpoint=True))
    model.train()
    with torch.no_grad():  # no labels: unchanged behaviour, full logits
        torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, logits, rtol=1e-5, atol=1e-6)
    calls = []
    hook = decoder_layers(model)[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))  # a recompute may stop early, inside the mlp
    out = model(input_ids=ids, labels=ids, use_cache=False, num_items_in_batch=30)
    assert out.logits is None and len(calls) == 1
    (grad,) = torch.autograd.grad(out.loss, model.get_output_embeddings().weight)
    assert rel_err(out.loss, ref) <= LOSS_TOL
    assert rel_err(grad, ref_grad) <= GRAD_TOL
    if family != "llama":  # untied Llama head: its grad needs no layer; tied ones recompute the layer
        assert len(calls) == 2, "checkpointing did not recompute the layer in backward"
    hook.remove()
    mean = model(input_ids=ids, labels=ids, use_cache=False).loss  # mean over valid targets, as HF
    assert rel_err(mean, ref * 30 / 39) <= LOSS_TOL

    undo()
    assert list(model.state_dict()) == keys
    after = {n: dict(m.__dict__) for n, m in model.named_modules()}
    assert after.keys() == before.keys()
    for name in before:
        assert after[name].keys() == before[name].keys(), name


def test_bad_options_raise_before_touching_the_model():
    model = _model("gpt2")
    mesh = init_sequence_parallel(1, 1, 1)
    with pytest.raises(ValueError, match="kv_offload=True offloads FPDT key/value chunks, but the mesh has fpdt_chunks=1"):
        apply_memory_options(model, mesh, PatchOptions(kv_offload=True))
    with pytest.raises(ValueError, match="mlp_chunks must be None"):
        PatchOptions(mlp_chunks=0)  # an option out of range never reaches the model: PatchOptions refuses it
    with pytest.raises(ValueError, match="inputs_on_device must be at most the model's 2 decoder layers, got 3"):
        apply_memory_options(model, mesh, PatchOptions(checkpoint=True, inputs_on_device=3))
    dropout = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32, resid_pdrop=0.1))
    with pytest.raises(ValueError, match="layer 0 mlp.dropout has p=0.1"):
        apply_memory_options(dropout, mesh, PatchOptions(mlp_chunks=2, loss_chunks=2))
    assert "forward" not in dropout.__dict__  # nothing was left half-applied
    assert len(decoder_layers(model)) == 2


# ---- memory presets ------------------------------------------------------------------------


def test_memory_presets_turn_on_exactly_their_knobs():
    from hf_longctx.config import PatchOptions
    from hf_longctx.integrations.patch_state import STATE_ATTR

    model = _model("llama")
    plain = init_sequence_parallel(1, 1, 1)
    layer = decoder_layers(model)[0]
    # checkpointing: HF's per-layer attribute, or (memory="max") the row-chunked layer's instance forward
    expected = {  # preset -> (mlp chunked, loss chunked, checkpointing) on a mesh without FPDT
        "off": (False, False, False), "balanced": (True, True, False), "high": (True, True, True), "max": (True, True, True),
    }
    for memory, (mlp, loss, ckpt) in expected.items():
        patch(model, plain, memory=memory)
        options = model.__dict__[STATE_ATTR].options
        assert (options.memory, options.kv_offload) == (memory, False)
        ckpt_on = bool(layer.__dict__.get("gradient_checkpointing")) or "forward" in layer.__dict__
        assert ("forward" in layer.mlp.__dict__, "forward" in model.__dict__, ckpt_on) == (mlp, loss, ckpt), memory
        unpatch(model)
    # K/V offload comes with "max" exactly when the mesh has FPDT chunks.
    assert PatchOptions.resolve("max", {}, 2) == PatchOptions(True, "auto", "auto", True, memory="max")
    assert PatchOptions.resolve("balanced", {}, 2) == PatchOptions(False, "auto", "auto", False, memory="balanced")
    assert PatchOptions.resolve(None, {"checkpoint": True}, 1) == PatchOptions(checkpoint=True)
    assert PatchOptions.resolve("high", {}, 2) == PatchOptions(True, "auto", "auto", "attention", memory="high")
    with pytest.raises(ValueError, match="checkpoint must be True"):
        patch(model, plain, checkpoint="layers")
    with pytest.raises(ValueError, match=r"memory='max'\) together with explicit \['kv_offload'\]"):
        patch(model, plain, memory="max", kv_offload=False)  # even a knob equal to its default
    with pytest.raises(ValueError, match="memory must be one of"):
        patch(model, plain, memory="low")
    assert "forward" not in model.__dict__ and STATE_ATTR not in model.__dict__
