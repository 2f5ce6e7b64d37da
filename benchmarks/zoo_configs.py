"""Tiny configs for benchmarks/zoo.py: every causal LM of transformers built small, with the
features that matter under SP switched on.

Where it sits: the builder half of the zoo (`zoo.py` runs the models; tests build the same
tiny models through `tiny_config`). Sizes come from `_SIZES` wherever a config has that
field (aliases of `attribute_map` included, sub-configs recursively); sliding windows of
WINDOW and attention chunks of CHUNK tokens are shorter than the zoo's documents, so the
feature is exercised. `_KINDS` gives hybrids and window families every kind of layer their
released checkpoints have (a default pattern is often attention- or Mamba-only);
`_CONSTRUCTOR_KW` the keywords that only the constructor takes; `_CHECKPOINT_FIELDS` the
fields a released checkpoint's config.json carries and the default config class lacks.
A size the class validates against another is dropped alone (its default is then used).
"""

from __future__ import annotations

WINDOW, CHUNK = 5, 4
_SIZES = dict(
    vocab_size=128, hidden_size=32, d_model=32, n_embd=32, intermediate_size=64, ffn_dim=64, n_inner=64,
    intermediate_size_mlp=64, num_hidden_layers=4, n_layer=4, num_layers=4, num_attention_heads=4, n_head=4,
    num_key_value_heads=2, head_dim=8, max_window_layers=2, max_position_embeddings=256, n_positions=256,
    sliding_window=WINDOW, attention_chunk_size=CHUNK, use_sliding_window=True,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1, index_topk=4, index_head_dim=8,
    index_n_heads=2, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    mamba_d_state=4, ssm_state_size=4, state_size=4, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    output_router_logits=False, use_cache=False, rotary_dim=4, hidden_size_global=32, encoder_hash_byte_group_vocab=64,
    encoder_attention_heads=4, decoder_attention_heads=4,
    vocab_size_per_layer_input=128, hidden_size_per_layer_input=8,  # Gemma 3n / Gemma 4 per-layer embeddings (default 262144 x 256 per layer)
    # Mamba-2 heads: 4 of 16 channels (expand 2 x hidden 32 = 64), 2 groups (one per rank under Ulysses 2)
    mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
    # Qwen4-Exp's sparse-attention indexer (its default config leaves these None and cannot be built)
    indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=2,
)

# Layer kinds a default config leaves out (its default pattern is attention only).
_KINDS = {
    # Kolibri 1.1: sliding layers and indexed (sparse top-k) layers; NVFP4 K/V rounding needs head_dim % 16 == 0
    "kolibri1_1": {"layer_types": ["sliding_attention", "indexed_attention", "sliding_attention", "indexed_attention"],
                   "head_dim": 16},
    "lfm2": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    # Granite-4's default pattern is Mamba-2 only; its checkpoints interleave attention layers
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]},
    "bamba": {"attn_layer_indices": [1, 3]},  # its default is Mamba-2 only; checkpoints interleave attention
    "mellum": {"layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]},
    # Zamba ties its shared attention block across hybrid layers: it needs two of them
    "zamba": {"layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"]},
    "mamba2": {"num_heads": 8, "head_dim": 8},  # 8 x 8 = expand 2 x hidden 32
    "gpt_neo": {"attention_types": [[["global", "local"], 2]]},  # sized for 4 layers
    # Laguna's default pattern is full attention only; its sliding layers exist in checkpoints
    "laguna": {"layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]},
    # MiMo-V2-Flash's value heads are narrower than its key heads (128 vs 192 released)
    "mimo_v2_flash": {"v_head_dim": 4},
    # KV sharing: the 2 last layers reuse the KV of the last earlier layer of their type, so
    # both types must occur before them; per-layer inputs and activation sparsity sized to 4 layers
    "gemma3n_text": {
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "num_kv_shared_layers": 2, "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 8,
        "laurel_rank": 4, "activation_sparsity_pattern": [0.0] * 4, "intermediate_size": [64] * 4,
    },
    # North's checkpoints give RoPE per layer type (its default config gives none and cannot be built)
    "cohere_compass_text": {
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {t: {"rope_type": "default", "rope_theta": 10000.0} for t in ("sliding_attention", "full_attention")},
    },
}

# Constructor-only keywords (no config field of that name): Dots3-Note's sliding layers read
# their sizes from `swa_*` aliases into a per-layer config that the sizes above do not reach.
_CONSTRUCTOR_KW = {
    "dots3_note_text": dict(
        swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=16, swa_kv_lora_rank=16,
        swa_head_dim=16, swa_qk_nope_head_dim=8, swa_v_head_dim=8,
    ),
}


def _dbrx_rope_theta(cfg) -> None:
    """Released DBRX checkpoints carry `attn_config.rope_theta` and `clip_qkv` (8); transformers
    5.23's DbrxAttentionConfig lost the first and defaults the second to None, but DbrxAttention
    reads the one and clamps with the other."""
    if getattr(cfg, "attn_config", None) is not None:
        if not hasattr(cfg.attn_config, "rope_theta"):
            cfg.attn_config.rope_theta = 10000.0
        if cfg.attn_config.clip_qkv is None:
            cfg.attn_config.clip_qkv = 8.0


# Fields a real checkpoint's config.json has and the default config class lacks.
_CHECKPOINT_FIELDS = {"dbrx": _dbrx_rope_theta}


def _get(cfg, name: str, default=None):
    """getattr that tolerates configs whose per-layer attributes refuse a global read
    (heterogeneous configs raise AmbiguousGlobalPerLayerAttributeError)."""
    try:
        return getattr(cfg, name, default)
    except Exception:  # noqa: BLE001
        return cfg.to_dict().get(name, default)


def _every_kind(seq: list, n: int) -> list:
    """The first n entries of a per-layer pattern, widened so that every kind of layer of
    the full pattern occurs (a 4-layer Qwen3-Next must still contain a full-attention layer)."""
    out = list(seq[:n])
    for kind in dict.fromkeys(seq):
        if kind not in out:
            out.append(kind)
    return out


def tiny_config(cls, depth: int = 0):
    """`cls()` with the sizes above wherever the config has that field; sub-configs recursively."""
    default = cls()
    known = set(default.to_dict()) | set(getattr(cls, "attribute_map", {}) or {})  # aliases too (n_group -> num_expert_group)
    kw = {k: v for k, v in _SIZES.items() if k in known}
    if "q_lora_rank" in known and _get(default, "q_lora_rank") is not None:
        kw["q_lora_rank"] = 16
    if "kv_lora_rank" in known and _get(default, "kv_lora_rank"):  # MLA: one latent KV per query head
        kw["num_key_value_heads"] = kw["num_attention_heads"]
    for field in ("layer_types", "hybrid_override_pattern", "layers_block_type", "block_types"):
        seq = _get(default, field)
        if isinstance(seq, (list, tuple, str)) and len(set(seq)) > 1:
            tiny_seq = _every_kind(list(seq), 4)
            kw[field] = "".join(tiny_seq) if isinstance(seq, str) else tiny_seq
            for size in ("num_hidden_layers", "n_layer", "num_layers"):
                if size in kw:
                    kw[size] = len(tiny_seq)
    for k, v in default.to_dict().items():
        if ("dropout" in k or "pdrop" in k) and isinstance(v, float):
            kw[k] = 0.0
    for name, sub in (getattr(cls, "sub_configs", None) or {}).items():
        inst = _get(default, name)
        if type(inst).__name__ != "dict" and hasattr(inst, "to_dict"):  # declared as AutoConfig: the default's class
            sub = type(inst)
        if depth < 2 and isinstance(sub, type) and hasattr(sub, "model_type") and inst is not None:
            try:
                kw[name] = tiny_config(sub, depth + 1)
            except Exception:  # noqa: BLE001 -- keep the default sub-config
                pass
    kinds = {k: v for k, v in _KINDS.get(getattr(cls, "model_type", ""), {}).items() if k in known}
    aliases = getattr(cls, "attribute_map", {}) or {}
    for k in kinds:  # an alias of a field set here (Zamba: layer_types -> layers_block_type) must not override it
        for a, target in aliases.items():
            if target == k or a == k:
                kw.pop(a if target == k else target, None)
    kw.update(kinds)
    for field in ("layer_types", "layers_block_type"):
        if field in kinds:
            for size in ("num_hidden_layers", "n_layer", "num_layers"):
                if size in kw:
                    kw[size] = len(kinds[field])
    kw.update(_CONSTRUCTOR_KW.get(getattr(cls, "model_type", ""), {}))
    try:
        cfg = cls(**kw)
    except Exception:  # noqa: BLE001 -- a size the class validates against another (ZAYA: 1 expert per token)
        sizes = [k for k, v in kw.items() if not hasattr(v, "to_dict")]  # never a sub-config (its default is full size)
        for drop in [None, *sizes]:  # the first single size whose default makes it valid
            try:
                cfg = cls(**{k: v for k, v in kw.items() if k != drop}) if drop else None
            except Exception:  # noqa: BLE001
                cfg = None
            if cfg is not None:
                break
        if cfg is None:  # none: set what is accepted one by one
            cfg = cls()
            for k, v in kw.items():
                try:
                    setattr(cfg, k, v)
                except Exception:  # noqa: BLE001
                    pass
    _CHECKPOINT_FIELDS.get(getattr(cls, "model_type", ""), lambda c: None)(cfg)
    return cfg
