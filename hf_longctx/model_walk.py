"""Walking a Hugging Face model: the one place that says which modules are what.

Where it sits: the lowest floor (torch and, lazily, transformers). `patch()` and the
structural rule, the memory features, the FSDP2 plan and `verify()` all find a model's
parts here, so they agree on every model (e.g. GOT-OCR2, whose vision tower has as many
blocks as its text decoder). `hf_model`: the PreTrainedModel behind PEFT; `configs`: every
config an attention switch may touch; `decoder_layers` / `layer_mlp` / `mlp_attr`: the
decoder layers and their token-wise MLPs; `decoder_layer_classes`: the FSDP2 units;
`layer_kind`, `SkippedLayer`, `reduced_copy`: one decoder layer per kind."""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

# The attribute under which each family keeps its decoder layer's token-wise MLP (Llama-style
# `mlp`; Bamba/Jamba/Granite-4/Falcon-H1/LFM2 `feed_forward`, DBRX `ffn`, Mixtral-era `block_sparse_moe`).
MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "ffn")
# The instance attribute of a patched PreTrainedModel holding its `integrations/patch_state.PatchState`
# (named here, on the lowest floor, so the data stage can read what `patch()` remembered).
PATCH_STATE_ATTR = "_hf_longctx_patch"


def installed_patch(model: Any) -> Any:
    """What `patch()` keeps on `model` (its `integrations/patch_state.PatchState`), or None when it
    is not patched: the one reader of `PATCH_STATE_ATTR`. `integrations/patch_state.patch_state`
    types it; the data stage, a floor below, reads what `patch()` remembered through this."""
    return hf_model(model).__dict__.get(PATCH_STATE_ATTR)


def hf_model(model: Any):
    """The PreTrainedModel inside `model` (itself, or the base model of a PEFT wrapper)."""
    from transformers import PreTrainedModel

    seen = model
    for _ in range(4):  # PeftModel -> LoraModel -> PreTrainedModel at most
        if isinstance(seen, PreTrainedModel):
            return seen
        if callable(getattr(type(seen), "get_base_model", None)):
            seen = seen.get_base_model()
        elif type(seen).__module__.startswith("peft") and isinstance(getattr(seen, "model", None), nn.Module):
            seen = seen.model
        else:
            break
    raise TypeError(
        f"patch()/unpatch() need a transformers PreTrainedModel or a PEFT model wrapping one, got {type(model).__name__}; "
        "patch the model before wrapping it in DDP/FSDP"
    )


def configs(hf) -> list:
    """Every config whose `_attn_implementation` a switch may touch: the model's, its
    sub-configs at any depth, and those of nested PreTrainedModels (deduplicated by id)."""
    from transformers import PreTrainedModel

    out, seen, todo = [], set(), [hf.config] + [m.config for m in hf.modules() if isinstance(m, PreTrainedModel)]
    while todo:
        cfg = todo.pop()
        if cfg is None or id(cfg) in seen:
            continue
        seen.add(id(cfg))
        out.append(cfg)
        todo.extend(getattr(cfg, key, None) for key in getattr(cfg, "sub_configs", {}) or {})
    return out


def mlp_attr(layer: nn.Module) -> str | None:
    """The attribute name of the token-wise MLP of one decoder layer (one of MLP_NAMES), or None."""
    for name in MLP_NAMES:
        if isinstance(getattr(layer, name, None), nn.Module):
            return name
    return None


def layer_mlp(layer: nn.Module) -> nn.Module | None:
    """The token-wise MLP (or MoE block) of one decoder layer, or None if it has none."""
    name = mlp_attr(layer)
    return getattr(layer, name) if name else None


def _decoder_root(model: nn.Module) -> nn.Module:
    """Where the text decoder lives: transformers' own `get_decoder()` (the language model of a
    multimodal model, not its vision or audio tower), else the model itself."""
    get = getattr(model, "get_decoder", None)
    if callable(get):
        try:
            found = get()
        except (AttributeError, NotImplementedError, ValueError):  # exotic models without a rule
            found = None
        if isinstance(found, nn.Module) and any(isinstance(m, nn.ModuleList) and len(m) for m in found.modules()):
            return found
    return model


def decoder_layers(model: Any) -> nn.ModuleList:
    """THE decoder layer list of `model` (a PreTrainedModel, a PEFT wrapper or any nn.Module).

    Searched inside transformers' `get_decoder()` when it has layers (so a multimodal model's
    text layers, not its vision tower), among the non-empty `nn.ModuleList`s, in this order:
    1. the longest list whose every entry has an MLP under one of MLP_NAMES (Llama/Mistral/
       Qwen/Gemma `model.layers`, GPT-2 `transformer.h`, GPT-NeoX `gpt_neox.layers`,
       Bamba/Jamba `model.layers` with `feed_forward`);
    2. the longest list of transformers' GradientCheckpointingLayer (a hybrid whose MLP is a
       layer of its own, e.g. Nemotron-H's `mixer`);
    3. the list holding the most parameters (a family with neither, e.g. XLNet).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    hf = hf_model(model) if type(model).__module__.startswith("peft") else model
    root = _decoder_root(hf)
    lists = [m for m in root.modules() if isinstance(m, nn.ModuleList) and len(m)]
    for accept in (lambda m: layer_mlp(m) is not None, lambda m: isinstance(m, GradientCheckpointingLayer)):
        found = [ml for ml in lists if all(accept(m) for m in ml)]
        if found:
            return max(found, key=len)
    if lists:
        return max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters()))
    raise ValueError(
        f"{type(hf).__name__}: found no list of decoder layers (no nn.ModuleList of blocks: layers with an MLP "
        f"named {' / '.join(MLP_NAMES)}, transformers' GradientCheckpointingLayer, or any other)"
    )


def layer_kind(layer: nn.Module) -> tuple:
    """What makes two decoder layers the same for the exactness checks: class, submodule
    structure and attention type (full / sliding)."""
    return (
        type(layer).__name__,
        tuple(sorted((n, type(m).__name__) for n, m in layer.named_modules())),
        str(getattr(layer, "attention_type", getattr(getattr(layer, "self_attn", None), "sliding_window", None))),
    )


class SkippedLayer(nn.Module):
    """Stands in for a decoder layer the check does not need: passes hidden_states through."""

    def forward(self, hidden_states=None, *args, **kwargs):
        return hidden_states


def reduced_copy(hf) -> nn.Module:
    """fp32 copy of `hf` in eval mode keeping only the first decoder layer of each distinct kind."""
    seen, memo = set(), {}
    for layer in decoder_layers(hf):
        kind = layer_kind(layer)
        if kind in seen:
            memo[id(layer)] = SkippedLayer()  # deepcopy returns this instead of copying the layer
        seen.add(kind)
    out = copy.deepcopy(hf, memo)
    # eval mode: dropout and stochastic routing (PhiMoE samples its experts in training) are off,
    # so the comparison is deterministic; what SP changes -- how attention and the linear
    # mixers combine tokens across shards -- is the same arithmetic in both modes.
    return out.float().eval()


def decoder_layer_classes(model: Any) -> tuple[type, ...]:
    """The classes of `decoder_layers(model)`, sorted by name (the FSDP2 plan's per-layer units)."""
    return tuple(sorted({type(layer) for layer in decoder_layers(model)}, key=lambda c: c.__name__))
