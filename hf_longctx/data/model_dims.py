"""Model sizes read from a transformers config: the one parser of config fields.

Where it sits: `data/cost.py` builds the planner's cost model T(l) = a·l² + b·l from it
(Hydraulis / FlexSP cost models), and `capacity/estimate.py` the per-GPU memory estimate of
`hf-longctx plan` (FPDT §4, USP §4 memory analysis). Keeping one parser means the two
cannot disagree on, say, how many experts a token passes through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Model families whose MLP is a plain up/down projection (two matrices); every other
# family is assumed to use a gated MLP (gate, up, down: three matrices), as Llama does.
NON_GATED_MLP = frozenset(
    {"gpt2", "gpt_neox", "gpt_bigcode", "gptj", "gpt_neo", "starcoder2", "opt", "bloom",
     "falcon", "phi", "codegen", "mpt"}
)


def _attr(config: Any, names: tuple[str, ...], default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    if default is None:
        raise ValueError(f"config {type(config).__name__} has none of the attributes {names}")
    return default


@dataclass(frozen=True)
class ModelDims:
    """The sizes the memory model needs, read from a transformers config."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # active MLP width per token (experts_per_tok × expert width for MoE)
    vocab: int
    gated: bool
    tied: bool
    layer_params: int  # parameters of one decoder layer (all experts)
    root_params: int  # embeddings + final norm + LM head (once when tied)

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    @classmethod
    def from_config(cls, config: Any) -> "ModelDims":
        """The sizes of `config` (its text config); ValueError where one size does not hold for
        every layer (transformers' per-layer attributes: Gemma 4's head_dim), as for any config
        these sizes cannot be read from."""
        try:
            return cls._read(config)
        except RuntimeError as e:  # transformers' AmbiguousGlobalPerLayerAttributeError (a RuntimeError)
            if type(e).__name__ != "AmbiguousGlobalPerLayerAttributeError":
                raise
            raise ValueError(f"{type(config).__name__}: {e}") from e

    @classmethod
    def _read(cls, config: Any) -> "ModelDims":
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        h = int(_attr(config, ("hidden_size", "n_embd", "d_model")))
        layers = int(_attr(config, ("num_hidden_layers", "n_layer", "num_layers")))
        heads = int(_attr(config, ("num_attention_heads", "n_head", "num_heads")))
        head_dim = int(getattr(config, "head_dim", None) or h // heads)
        kv_heads = 1 if getattr(config, "multi_query", False) else int(_attr(config, ("num_key_value_heads", "n_head_kv"), heads))
        vocab = int(_attr(config, ("vocab_size",)))
        gated = getattr(config, "model_type", "") not in NON_GATED_MLP
        mats = 3 if gated else 2
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        moe_width = getattr(config, "moe_intermediate_size", None)
        if experts and getattr(config, "num_experts_per_tok", None):
            width = int(moe_width or _attr(config, ("intermediate_size",)))
            inter = int(config.num_experts_per_tok) * width
            mlp = int(experts) * mats * h * width + int(experts) * h  # experts + router
        else:
            inter = int(_attr(config, ("intermediate_size", "n_inner", "ffn_dim"), 4 * h))
            mlp = mats * h * inter
        q, kv = heads * head_dim, kv_heads * head_dim
        # Qwen2 always has q/k/v biases; Llama-style attention_bias adds o_proj's too.
        if getattr(config, "model_type", "") == "qwen2":
            bias = q + 2 * kv
        else:
            bias = (q + 2 * kv + h) if getattr(config, "attention_bias", False) else 0
        layer = h * q + 2 * h * kv + q * h + bias + mlp + 2 * h  # q, k, v, o, MLP, two norms
        tied = bool(getattr(config, "tie_word_embeddings", False))
        root = vocab * h * (1 if tied else 2) + h
        return cls(h, layers, heads, kv_heads, head_dim, inter, vocab, gated, tied, layer, root)
