"""patch()/unpatch() of hybrid models, one process: the registry, refusals, and the undo.

Refusals happen at patch() time, before anything changes and before any collective, so
they are tested with an SPMesh of the wanted degrees and no process group.
"""

from __future__ import annotations

import pytest
import torch

from hf_longctx.distributed.mesh import SPMesh, init_sequence_parallel
from hf_longctx.integrations.mixers.registry import refused_classes, sp_handled_classes
from hf_longctx.integrations.model_patch import is_patched, patch, unpatch
from tests.helpers.hybrid_models import build, packed_batch


def _mesh(ulysses: int, ring: int) -> SPMesh:
    return SPMesh(dp=1, ring=ring, ulysses=ulysses, fpdt_chunks=1, dp_rank=0, ring_rank=0, ulysses_rank=0)


def test_registry_lists_every_supported_family_and_the_refused_ones():
    handled = {k.rsplit(".", 1)[1]: v for k, v in sp_handled_classes().items()}
    assert set(handled) == {
        "Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv", "Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet",
        "Qwen3_5MoeGatedDeltaNet", "OlmoHybridGatedDeltaNet", "BambaMixer", "FalconH1Mixer",
        "GraniteMoeHybridMambaLayer", "NemotronHMamba2Mixer", "Zamba2MambaMixer", "RecurrentGemmaRecurrentBlock",
    }
    refused = {k.rsplit(".", 1)[1]: v for k, v in refused_classes().items()}
    assert "Mamba-1" in refused["JambaMambaMixer"] and "Mamba-1" in refused["ZambaMambaMixer"]
    # every key names a real class of the pinned transformers
    import importlib
    import importlib.util

    from hf_longctx._compat import package_version

    for key in [*sp_handled_classes(), *refused_classes()]:
        module, cls = key.rsplit(".", 1)
        if importlib.util.find_spec(module.rsplit(".", 1)[0]) is None:  # a family newer than this transformers
            assert package_version("transformers") < (5, 24), f"{key}: no such module in the pinned transformers"
            continue
        assert isinstance(getattr(importlib.import_module(module), cls), type), key


def test_mamba1_hybrid_is_refused_with_the_reason():
    import transformers as tf

    cfg = tf.JambaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=1, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                         num_experts=2, mamba_d_state=4, mamba_dt_rank=2, use_mamba_kernels=False)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="JambaMambaMixer.*Mamba-1"):
        patch(model, init_sequence_parallel())
    assert not is_patched(model) and "forward" not in model.model.layers[0].mamba.__dict__


@pytest.mark.parametrize(
    "family,ulysses,ring,pattern",
    [
        ("qwen3_next", 2, 2, r"Qwen3NextGatedDeltaNet: mixers='heads' splits its 3 value heads .* 4 ranks .*mixers='state'"),
        ("falcon_h1", 4, 1, r"FalconH1Mixer: mixers='heads' splits its 3 heads .* 4 ranks .*at most 3 ranks"),
    ],
)
def test_head_counts_the_head_all_to_all_cannot_serve(family, ulysses, ring, pattern):
    """mixers='heads' on a group larger than the heads is refused naming the numbers, before
    anything changes; the default ('auto') passes the state there instead."""
    model = build(family)
    with pytest.raises(ValueError, match=pattern):
        patch(model, _mesh(ulysses, ring), mixers="heads")
    assert not is_patched(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    patch(model, _mesh(ulysses, ring))
    assert is_patched(model)
    unpatch(model)


@pytest.mark.parametrize("family", ["qwen3_5_text", "lfm2", "bamba", "recurrent_gemma"])
def test_unpatch_restores_the_mixers(family):
    model = build(family)
    batch = packed_batch(docs=[7, 5])
    mixers = [m for m in model.modules() if type(m).__name__.endswith(("GatedDeltaNet", "ShortConv", "Mixer", "RecurrentBlock"))]
    assert mixers
    patch(model, init_sequence_parallel())
    assert all("forward" in m.__dict__ for m in mixers)
    unpatch(model)
    assert not any("forward" in m.__dict__ for m in mixers)
    with torch.no_grad():  # the unpatched model runs transformers' own path again
        out = model(input_ids=batch["input_ids"][:, :7], use_cache=False).logits
        assert torch.isfinite(out).all()


def test_group_bank_with_linear_mixers_patches_and_unpatches():
    """Each micro-batch of a bank runs its mixers on its own group (`MixerBinding.resolve`);
    tests/distributed/test_hybrid_state.py runs a flexible step."""
    from hf_longctx import init_group_bank

    model = build("lfm2")
    patch(model, init_group_bank(heads=model.config.num_attention_heads))
    assert is_patched(model)
    unpatch(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
