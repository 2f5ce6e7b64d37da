"""patch() / unpatch() mechanics in one process (world-1 mesh), with real from_pretrained models.

Covers: the attention registration under a unique name per call (no mask registration: HF
never scans the positions for packed documents, a host sync) and its removal; every config
restored exactly; idempotence; PEFT before and after get_peft_model; eval forward; generate()
after unpatch (identical tokens to a never-patched model); and every refusal
(attention dropout, dynamic/longrope RoPE, models off the attention interface) raising at
patch() time with the field to change, without touching the model. With one rank USP is the
local kernel, so the patched logits equal HF's: fp32, 2 layers, rel 1e-5 (summation order of
the CPU flash kernel vs sdpa only).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers as tf
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from hf_longctx.data.sharding import shard_batch
from hf_longctx.distributed.gather import gather_sequence
from hf_longctx.distributed.mesh import init_sequence_parallel
from hf_longctx.errors import NotSupported
from hf_longctx.integrations.model_patch import is_patched, patch, unpatch
from tests.helpers.families import family_config, packed_batch, rel
from tests.helpers.transformers_release import on_attention_interface

TOL = 1e-5


def saved(tmp_path, config, name="m"):
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / name)
    return tmp_path / name


def load(path, **kw):
    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return saved(tmp_path_factory.mktemp("llama"), family_config("llama"))


@pytest.fixture
def mesh():
    return init_sequence_parallel()


def our_names():
    return {k for k in AttentionInterface._global_mapping if k.startswith("hf_longctx")}


def test_patch_registers_switches_and_unpatch_restores_exactly(llama_path, mesh):
    model = load(llama_path).train()
    before_attn, before_mask = set(AttentionInterface._global_mapping), set(AttentionMaskInterface._global_mapping)
    original = model.config._attn_implementation_internal
    assert patch(model, mesh) is model and is_patched(model)
    name = model.config._attn_implementation
    assert name.startswith("hf_longctx") and name in AttentionInterface._global_mapping
    # no mask entry: HF's mask creation returns None before scanning positions (a host sync);
    # a padding mask is refused by the pre-forward hook instead (test_padding_mask_is_refused)
    assert name not in AttentionMaskInterface._global_mapping
    assert model.model.config._attn_implementation == name
    unpatch(model)
    assert not is_patched(model)
    assert model.config._attn_implementation_internal == original
    assert set(AttentionInterface._global_mapping) == before_attn
    assert set(AttentionMaskInterface._global_mapping) == before_mask
    assert not model._forward_pre_hooks and not model._forward_hooks
    unpatch(model)  # a second unpatch is a no-op


def test_idempotent_and_unique_names(llama_path, mesh):
    a, b = load(llama_path), load(llama_path)
    before = our_names()  # other tests' live patches are theirs: compare with this test's start
    patch(a, mesh)
    name = a.config._attn_implementation
    patch(a, mesh)
    assert a.config._attn_implementation == name and len(a._forward_pre_hooks) == 1
    patch(b, mesh)
    assert b.config._attn_implementation != name  # one binding per call: no shared global state
    patch(a, mesh, mlp_chunks=None, checkpoint=False)  # same options: still the same binding
    assert a.config._attn_implementation == name
    unpatch(a)
    unpatch(b)
    assert our_names() == before


def test_patched_forward_train_and_eval_match_hf(llama_path, mesh):
    ref, model = load(llama_path).train(), patch(load(llama_path).train(), mesh)
    batch = packed_batch()
    ref_out = ref(**batch, use_cache=False)
    shard = shard_batch(batch, mesh)
    out = model(**shard)
    assert out.past_key_values is None  # use_cache forced off
    assert rel(out.loss, ref_out.loss) <= TOL
    assert rel(gather_sequence(out.logits, shard, mesh), ref_out.logits) <= TOL
    model.eval()
    ref.eval()
    with torch.no_grad():
        eval_shard = shard_batch({k: v for k, v in batch.items() if k != "labels"}, mesh)
        logits = gather_sequence(model(**eval_shard).logits, eval_shard, mesh)
        assert rel(logits, ref(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits) <= TOL
    unpatch(model)


def test_generate_refused_while_patched_and_identical_after_unpatch(llama_path, mesh):
    model, fresh = load(llama_path).eval(), load(llama_path).eval()
    prompt = torch.tensor([[5, 17, 42, 9]])
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    patch(model, mesh)
    with pytest.raises(ValueError, match="unpatch"):
        model.generate(prompt, **kw)
    unpatch(model)
    assert torch.equal(model.generate(prompt, **kw), fresh.generate(prompt, **kw))


@pytest.mark.parametrize("memory", [None, "max"])
def test_suspended_generates_as_unpatched_and_puts_the_same_patch_back(llama_path, mesh, memory, monkeypatch):
    """`suspended`: inside, generate() as a never-patched model; on exit the same PatchState
    (options, dry-run report, registration) is back, no check of the model runs again, and the
    patched step is the one before (memory="max": the row-chunked layers, bound afresh)."""
    from hf_longctx.integrations import model_patch

    model, fresh = patch(load(llama_path).train(), mesh, memory=memory), load(llama_path).eval()
    state, name = model_patch.patch_state(model), model.config._attn_implementation
    split = state.split  # memory="max": its learnt projections must survive the suspension
    batch = packed_batch()
    before = model(**shard_batch(batch, mesh)).loss.detach()
    prompt, kw = torch.tensor([[5, 17, 42, 9]]), dict(max_new_tokens=6, do_sample=False, pad_token_id=0)

    def no_second_check(*_, **__):
        raise AssertionError("suspended() checked the model again")

    monkeypatch.setattr(model_patch, "_check_model", no_second_check)
    with model_patch.suspended(model):
        assert not is_patched(model) and model.config._attn_implementation == "sdpa"
        assert not model._forward_pre_hooks and not model._forward_hooks and "forward" not in model.__dict__
        model.eval()
        assert torch.equal(model.generate(prompt, **kw), fresh.generate(prompt, **kw))
        model.train()
    assert model_patch.patch_state(model) is state and model.config._attn_implementation == name
    assert state.options is model_patch.patch_state(model).options and name in AttentionInterface._global_mapping
    assert (state.split is not None) == (memory == "max") and state.split is split
    torch.testing.assert_close(model(**shard_batch(batch, mesh)).loss, before, rtol=0, atol=0)
    monkeypatch.undo()  # the patch below checks its model, as every new patch does
    with model_patch.suspended(model):
        patch(model, mesh)  # a patch made inside the block comes off at its end; the suspended one is back
    assert model_patch.patch_state(model) is state and model.config._attn_implementation == name
    unpatch(model)
    assert not model._forward_pre_hooks and "forward" not in model.__dict__


def test_a_fused_patch_compiles_nothing_again_after_suspended(llama_path, mesh):
    """The per-rank rollout suspends the patch every step: back on, a fused patch runs the graphs
    it compiled before (dynamo's graphs live with the compiled functions' code, not with the
    wrappers `install` makes again) -- no graph is compiled after the first step."""
    import torch._dynamo.utils as dynamo_utils

    from hf_longctx.integrations import model_patch

    model = patch(load(llama_path).train(), mesh, fused=True)
    shard = shard_batch(packed_batch(), mesh)
    before = model(**shard).loss
    before.backward()
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    assert graphs > 0  # the first step compiled the fused regions
    with model_patch.suspended(model):
        pass
    after = model(**shard).loss
    after.backward()
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    unpatch(model)


@pytest.mark.parametrize("order", ["before", "after"])
def test_peft_before_or_after_get_peft_model(llama_path, mesh, order):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    base = load(llama_path).train()
    original, before = base.config._attn_implementation, our_names()
    model = get_peft_model(patch(base, mesh), cfg) if order == "before" else patch(get_peft_model(base, cfg), mesh)
    assert is_patched(model) and base.config._attn_implementation.startswith("hf_longctx")
    out = model(**shard_batch(packed_batch(), mesh))
    out.loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
    unpatch(model)
    assert base.config._attn_implementation == original and our_names() == before


# ---- refusals: at patch() time, with the field to change, model untouched -----------------


def assert_refused(model, mesh, exc, *needles, **options):
    before = (model.config._attn_implementation, set(AttentionInterface._global_mapping))
    with pytest.raises(exc) as info:
        patch(model, mesh, **options)
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in: {info.value}"
    assert (model.config._attn_implementation, set(AttentionInterface._global_mapping)) == before
    assert not is_patched(model)


@pytest.mark.parametrize(
    "family,field",
    [("gpt2", "attn_pdrop"), ("gpt_bigcode", "attn_pdrop"), ("llama", "attention_dropout"), ("gpt_neox", "attention_dropout")],
)
def test_attention_dropout_refused_with_field_name(tmp_path, mesh, family, field):
    config = family_config(family)
    setattr(config, field, 0.1)  # GPT-2 and GPTBigCode default to 0.1
    model = load(saved(tmp_path, config))
    assert_refused(model, mesh, ValueError, f"{field} = 0.1", f"from_pretrained(path, {field}=0.0)")


def test_gpt2_default_config_refused_and_fixed_by_loading_with_zero(tmp_path, mesh):
    path = saved(tmp_path, tf.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64))
    assert_refused(load(path), mesh, ValueError, "attn_pdrop = 0.1")
    model = load(path, attn_pdrop=0.0)
    patch(model, mesh)
    unpatch(model)


def test_dropout_changed_after_loading_is_still_refused(tmp_path, mesh):
    config = family_config("gpt2")
    config.attn_pdrop = 0.1
    model = load(saved(tmp_path, config))
    model.config.attn_pdrop = 0.0  # the built nn.Dropout still has p = 0.1
    assert_refused(model, mesh, ValueError, "built with attention dropout 0.1")


@pytest.mark.parametrize("rope", ["dynamic", "longrope"])
def test_length_dependent_rope_refused(tmp_path, mesh, rope):
    params = {"rope_type": rope, "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 32}
    if rope == "longrope":
        params.update(short_factor=[1.0] * 4, long_factor=[2.0] * 4)
    config = family_config("llama")
    config.rope_parameters = params
    config.max_position_embeddings = 128
    model = load(saved(tmp_path, config))
    assert_refused(model, mesh, ValueError, f"rope_type '{rope}'", "static RoPE")


# family: (config, modeling module, what patch() says once the family is on the interface: None
# = it patches; else the cause it is refused for)
OFF_INTERFACE = {
    "gptj": (tf.GPTJConfig(vocab_size=128, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, attn_pdrop=0.0),
             "transformers.models.gptj.modeling_gptj", None),
    "gptneo": (tf.GPTNeoConfig(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4,
                               attention_types=[[["global", "local"], 1]], attention_dropout=0.0),
               "transformers.models.gpt_neo.modeling_gpt_neo", None),
    # On the interface from 5.25, but FalconDecoderLayer calls its attention without **kwargs
    "falcon": (tf.FalconConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
               "transformers.models.falcon.modeling_falcon",
               "the sequence-parallel metadata keyword never reaches FalconAttention: the decoder layer calling it does "
               "not forward its **kwargs"),
}


@pytest.mark.parametrize("family", sorted(OFF_INTERFACE))
def test_models_off_the_attention_interface_refused(tmp_path, mesh, family):
    """Families whose attention bypasses AttentionInterface are refused; once transformers
    moves one onto the interface (GPT-J in 5.24, Falcon in 5.25) it patches (the zoo subset,
    tests/integration/test_zoo_subset.py, checks it is exact on 2 ranks) or is refused for the
    cause that remains, named."""
    config, module_path, on_interface_cause = OFF_INTERFACE[family]
    model = load(saved(tmp_path, config))
    if not on_attention_interface(module_path):
        assert_refused(model, mesh, NotSupported, type(model).__name__, "AttentionInterface", "Llama")
    elif on_interface_cause is None:
        patch(model, mesh)
        assert is_patched(model)
        unpatch(model)
    else:
        assert_refused(model, mesh, NotSupported, on_interface_cause)


def test_option_errors(llama_path, mesh):
    model = load(llama_path)
    assert_refused(model, mesh, ValueError, "fpdt_chunks=1", kv_offload=True)
    assert_refused(model, mesh, ValueError, "mlp_chunks", mlp_chunks=0)
    with pytest.raises(TypeError, match="SPMesh"):
        patch(model, object())
    with pytest.raises(TypeError, match="PreTrainedModel"):
        patch(torch.nn.Linear(2, 2), mesh)


def test_plain_call_without_shard_is_refused(llama_path, mesh):
    model = patch(load(llama_path), mesh)
    with pytest.raises(ValueError, match="shard_batch"):
        model(input_ids=torch.tensor([[1, 2, 3]]))
    shard = shard_batch(packed_batch(), mesh)
    with pytest.raises(ValueError, match="output_attentions"):
        model(**shard, output_attentions=True)
    unpatch(model)


def test_layers_of_one_forward_share_one_ring_plan(llama_path, mesh, monkeypatch):
    # Planning is pure Python over every document: it must run once per batch, not once per
    # layer (a 32-layer model re-planning 1000 documents cost seconds per micro-batch).
    import hf_longctx.ops.usp as usp

    calls = []
    real = usp.ring_plan
    monkeypatch.setattr(usp, "ring_plan", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    model = patch(load(llama_path).train(), mesh)
    assert model.config.num_hidden_layers > 1
    out = model(**shard_batch(packed_batch(), mesh))
    out.loss.backward()
    assert len(calls) == 1, f"{len(calls)} plans for {model.config.num_hidden_layers} layers"
    model(**shard_batch(packed_batch(), mesh))  # the next batch plans again (the cache is per batch)
    assert len(calls) == 2
    unpatch(model)


def test_padding_mask_is_refused(llama_path, mesh):
    model = patch(load(llama_path).train(), mesh)
    batch = shard_batch(packed_batch(vocab=model.config.vocab_size), mesh)
    ones = torch.ones_like(batch["input_ids"])
    model(**batch, attention_mask=ones)  # all ones: nothing dropped, accepted
    ones[0, -1] = 0
    with pytest.raises(ValueError, match="attention_mask with padding zeros"):
        model(**batch, attention_mask=ones)
    ids = batch.pop("input_ids")
    with pytest.raises(ValueError, match="attention_mask with padding zeros"):  # by position, as forward(ids, mask)
        model(ids, ones, **batch)


@pytest.mark.parametrize("unsafe", [False, True])
def test_patched_forward_never_scans_positions_for_packed_documents(llama_path, mesh, monkeypatch, unsafe):
    """transformers' `find_packed_sequence_indices` ends in bool() of a device tensor: a host
    sync per forward. A patched model's forward never calls it (without the dry run, the mask
    function that notes each forward's windows is registered, and HF does call it: the control)."""
    import transformers.masking_utils as mu

    calls = []
    real = mu.find_packed_sequence_indices
    monkeypatch.setattr(mu, "find_packed_sequence_indices", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = load(llama_path).train()
    batch = shard_batch(packed_batch(vocab=model.config.vocab_size), mesh)
    model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    assert calls, "the unpatched model scans the positions (the control)"
    patch(model, mesh, unsafe_skip_exactness_check=unsafe)  # its dry run builds masks of its own: not counted
    calls.clear()
    model(**batch).loss.backward()
    assert bool(calls) == unsafe


def test_gradient_checkpointing_flag_keeps_an_unsafe_patch_unsafe(llama_path, mesh, tmp_path):
    """TrainingArguments(gradient_checkpointing=True) re-patches with checkpoint=True; a model the
    user patched with unsafe_skip_exactness_check=True is re-patched the same way (no dry run
    it was patched to skip)."""
    from transformers import TrainingArguments

    from hf_longctx.integrations.model_patch import patch_state
    from hf_longctx.training.base.construction import map_activation_checkpointing

    model = patch(load(llama_path).train(), mesh, unsafe_skip_exactness_check=True)
    map_activation_checkpointing(model, TrainingArguments(str(tmp_path), gradient_checkpointing=True, report_to=[]))
    state = patch_state(model)
    assert state.options.checkpoint is True and state.probe is None
    unpatch(model)


def test_gradient_checkpointing_flag_keeps_the_other_options(llama_path, mesh, tmp_path):
    """The re-patch that adds checkpoint=True keeps the options that are not knobs of a preset:
    the LM head's chunk rows, the fused regions and a named attention backend."""
    from transformers import TrainingArguments

    from hf_longctx.integrations.model_patch import patch_state
    from hf_longctx.training.base.construction import map_activation_checkpointing

    model = patch(load(llama_path).train(), mesh, loss_chunks="auto", loss_chunk_rows=512, attention_backend="math",
                  unsafe_skip_exactness_check=True)
    map_activation_checkpointing(model, TrainingArguments(str(tmp_path), gradient_checkpointing=True, report_to=[]))
    options = patch_state(model).options
    assert options.checkpoint is True and options.loss_chunk_rows == 512 and options.attention_backend == "math"
    unpatch(model)
    model = patch(load(llama_path).train(), mesh, memory="balanced", fused=True, unsafe_skip_exactness_check=True)
    before = patch_state(model).options
    map_activation_checkpointing(model, TrainingArguments(str(tmp_path), gradient_checkpointing=True, report_to=[]))
    state = patch_state(model)  # the preset's knobs and every other option, whole, with checkpointing added
    assert state.options == dataclasses.replace(before, checkpoint=True, memory=None)
    assert "checkpoint" in state.explicit and state.split is not None
    unpatch(model)


def test_the_reference_is_patched_with_the_policys_options_whole(llama_path, mesh):
    """DPO's / GRPO's frozen reference runs as the policy does: every option of the policy's patch
    (the preset's knobs, the LM head's chunk rows, the named attention kernel), none dropped."""
    from hf_longctx.integrations.model_patch import patch_state
    from hf_longctx.training.base.reference import reference_on_mesh

    policy = patch(load(llama_path), mesh, memory="balanced", loss_chunk_rows=512, attention_backend="math",
                   unsafe_skip_exactness_check=True)
    ref = reference_on_mesh(load(llama_path), policy, mesh)
    assert patch_state(ref).options == patch_state(policy).options
    assert not any(p.requires_grad for p in ref.parameters()) and not ref.training
    unpatch(ref)
    unpatch(policy)
