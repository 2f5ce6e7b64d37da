"""The structural exactness rule of patch() (integrations/probe/dry_run.py), in one process.

Each refused family is built tiny (benchmarks/zoo.py's builder) so that its token mixer is
present; patch() must raise BEFORE changing anything, naming the module class and the real
cause. Exact families must pass, and the dry run must leave no trace (RNG, training mode,
attention implementation, gradients, registrations).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.modeling_utils import AttentionInterface

from benchmarks.zoo import tiny_config
from hf_longctx.distributed.mesh import init_sequence_parallel
from hf_longctx.integrations.model_patch import USED_ATTENTION_KWARGS, is_patched, unpatch
from hf_longctx.integrations.model_patch import patch as _patch


def build(model_type: str, **overrides):
    cfg = tiny_config(tf.CONFIG_MAPPING[model_type])
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


@pytest.fixture(scope="module")
def mesh():
    return init_sequence_parallel()


@pytest.fixture(autouse=True)
def patch():
    """`patch` that unpatches every model it patched when the test ends, so no test leaves
    an attention registration behind in transformers' global registries."""
    patched = []

    def patch_and_track(model, *args, **kwargs):
        out = _patch(model, *args, **kwargs)
        patched.append(model)
        return out

    yield patch_and_track
    for model in patched:
        unpatch(model)


REFUSED = {
    "jamba": ["JambaMambaMixer", "model.layers.0.mamba", "Mamba-1"],
    "llama4_text": ["chunked_overlay", "chunked local attention"],
    "nemotron": ["NemotronAttention", "does not forward its **kwargs"],
    "stablelm": ["StableLmAttention", "does not forward its **kwargs"],
    "deepseek_v32": ["Indexer", "top-k"],
    "bert": ["BertLMHeadModel is an encoder", "bidirectional"],  # said before the dry run, by cause
    "bert-generation": ["BertGenerationSelfAttention", "is not causal"],  # a non-causal attention the text path calls
    "whisper": ["WhisperForCausalLM", "without shift_labels"],  # its own loss on unshifted labels, mean per shard
}

@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_refused_at_patch_with_the_real_cause(mesh, model_type, patch):
    model = build(model_type)
    impl, names = model.config._attn_implementation, set(AttentionInterface._global_mapping)
    with pytest.raises(ValueError) as err:
        patch(model, mesh)
    for part in REFUSED[model_type]:
        assert part.lower() in str(err.value).lower(), f"{model_type}: {part!r} not in {err.value}"
    assert not is_patched(model) and model.config._attn_implementation == impl
    assert set(AttentionInterface._global_mapping) == names  # the probe's registration is gone


@pytest.mark.parametrize("model_type", ["llama", "mistral", "mixtral", "gemma3_text", "deepseek_v3", "diffllama", "phimoe",
                                        "gpt_oss"])
def test_exact_families_pass_and_the_probe_leaves_no_trace(mesh, model_type, patch):
    model = build(model_type).train()
    model.model.layers[0].eval()  # a mixed training mode must come back as it was
    rng = torch.get_rng_state()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    patch(model, mesh)
    assert torch.equal(rng, torch.get_rng_state())
    assert model.training and not model.model.layers[0].training and model.model.layers[1].training
    assert all(p.grad is None and torch.equal(p, params[n]) for n, p in model.named_parameters())
    # every decoder layer calls attention at least once (DiffLlama twice); the patched forward
    # checks its own count against this one (test_patch.py)
    assert model._hf_longctx_patch.probe.attention_calls >= model.config.num_hidden_layers
    assert not any(k.startswith("hf_longctx_probe") for k in AttentionInterface._global_mapping)


def test_a_non_causal_tower_the_text_path_never_calls_does_not_refuse(mesh, patch):
    """Gemma 3 (multimodal) carries a Siglip vision tower (is_causal=False); a text-only
    forward never calls it, so the dry run does not refuse it (a name check did)."""
    model = build("gemma3")
    assert any(getattr(m, "is_causal", True) is False for m in model.modules() if type(m).__name__ == "SiglipAttention")
    patch(model, mesh)
    assert is_patched(model) and not model._hf_longctx_patch.probe.non_causal


def test_a_window_only_the_masks_carry_is_applied_not_refused(mesh, patch):
    """PhiMoE builds a sliding-window mask but does not pass the window to the attention (HF's
    sdpa/eager paths apply it through the mask): every mask of the forward has the same
    window, so sp_attention takes it from there and the rule does not refuse."""
    from hf_longctx.integrations.attention import mask_implied_window

    model = build("phimoe")
    patch(model, mesh)
    probe = model._hf_longctx_patch.probe
    assert probe.windows_mask == {5} and not probe.windows_attention
    assert mask_implied_window(probe.mask_windows) == 5
    # masks of several kinds (full + sliding layers) imply nothing: each layer must pass its own
    assert mask_implied_window([frozenset(), frozenset({5})]) is None
    assert mask_implied_window([frozenset({5}), frozenset({5})]) == 5


def test_unsafe_keyword_skips_the_rule(mesh, patch):
    model = build("jamba")
    patch(model, mesh, unsafe_skip_exactness_check=True)
    assert is_patched(model) and model._hf_longctx_patch.probe is None
    # patching again with the rule on is not "already patched": the rule runs and refuses
    with pytest.raises(ValueError, match="Mamba-1"):
        patch(model, mesh)
    assert not is_patched(model)


def test_a_module_class_handled_by_an_sp_wrapper_is_trusted(mesh, patch):
    from hf_longctx.config import PatchOptions
    from hf_longctx.integrations.exactness import refuse_inexact
    from hf_longctx.integrations.model_patch import IGNORED_ATTENTION_KWARGS

    model = build("jamba")
    mixer = type(model.model.layers[0].mamba)
    kw = dict(used_kwargs=USED_ATTENTION_KWARGS, ignored_kwargs=IGNORED_ATTENTION_KWARGS)
    with pytest.raises(ValueError, match="JambaMambaMixer"):
        refuse_inexact(model, mesh, PatchOptions(), **kw)
    # the mixer (and the convolution inside it) is then the wrapper's business
    assert refuse_inexact(model, mesh, PatchOptions(), handled=frozenset({mixer}), **kw).attention_calls > 0


def test_wrapped_hybrids_pass_the_rule(mesh, patch):
    for model_type in ("qwen3_next", "lfm2", "recurrent_gemma"):
        model = build(model_type)
        patch(model, mesh)
        assert is_patched(model) and model._hf_longctx_patch.mixers.modules > 0, model_type


def test_moe_router_logits_refused_at_patch_and_at_forward(mesh, patch):
    with pytest.raises(ValueError, match="output_router_logits"):
        patch(build("mixtral", output_router_logits=True), mesh)
    model = patch(build("mixtral"), mesh)
    from hf_longctx.data.sharding import shard_batch

    ids = torch.randint(3, 100, (1, 12))
    with pytest.raises(ValueError, match="output_router_logits"):
        model(**shard_batch({"input_ids": ids, "labels": ids}, mesh), output_router_logits=True)


def test_attention_compute_dtype_follows_hf_flash_rule():
    """compute_dtype: HF's flash rule -- an fp32 query (RoPE may upcast it) runs in the
    autocast dtype, else in the module's weights' dtype (bf16 weights: bf16, instead of an
    error); a bf16 query stays bf16; fp16 is refused; a Conv1D module (GPT-2) works."""
    from transformers.pytorch_utils import Conv1D

    from hf_longctx.integrations.attention import compute_dtype

    q32, q16 = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16)
    bf16_linear = torch.nn.Linear(8, 8).to(torch.bfloat16)
    assert compute_dtype(q32, bf16_linear) == torch.bfloat16
    assert compute_dtype(q32, torch.nn.Linear(8, 8)) == torch.float32
    assert compute_dtype(q16, torch.nn.Linear(8, 8)) == torch.bfloat16
    assert compute_dtype(q32, Conv1D(8, 8)) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_dtype(q32, torch.nn.Linear(8, 8)) == torch.bfloat16
    with pytest.raises(ValueError, match="fp16"):
        compute_dtype(q32, torch.nn.Linear(8, 8).half())


def test_the_dry_run_costs_four_forwards():
    """Runs A, B, C and one extra forward for the shift_labels loss check (run A computes the
    first loss): four forwards of the model, not five."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_longctx.integrations.probe.dry_run import probe_model

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64)
    model = LlamaForCausalLM(cfg)
    forwards = []
    handle = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    from hf_longctx.integrations.model_patch import IGNORED_ATTENTION_KWARGS

    report = probe_model(model, "sp_batch", USED_ATTENTION_KWARGS, IGNORED_ATTENTION_KWARGS)
    handle.remove()
    assert len(forwards) == 4
    assert not [p for p in report.problems if "shift_labels" in p]
