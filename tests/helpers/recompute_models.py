"""Tiny models of the recompute tests (checkpoint="attention", layer splitting).

`_model(family)` builds, seeded, one model per feature the recompute must carry: Llama
(GQA), Mistral with a sliding window smaller than the documents, GPT-OSS (attention sinks,
alternating sliding / full layers, MoE), GPT-2 with residual and embedding dropout (the
masks must repeat in the recompute) and LFM2 (short-convolution mixers recomputed with the
rest of the layer). Used by tests/distributed/test_checkpoint_attention.py and, with two more
families, test_layer_split.py.
"""

from __future__ import annotations

import torch


def _model(family: str):
    import transformers as tf

    torch.manual_seed(0)
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=96, max_position_embeddings=128)
    if family == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    if family == "mistral":  # sliding window smaller than the documents
        return tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=9))
    if family == "gpt_oss":  # attention sinks + alternating sliding / full layers
        return tf.GptOssForCausalLM(tf.GptOssConfig(
            **{**common, "intermediate_size": 32}, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
            sliding_window=9, layer_types=["sliding_attention", "full_attention"]))
    if family == "gpt2_dropout":  # residual / embedding dropout: the masks must repeat in the recompute
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=128,
                                                resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.0))
    if family == "lfm2":  # hybrid: short-convolution mixers (recomputed with the rest of the layer)
        from benchmarks.zoo import tiny_config

        return tf.AutoModelForCausalLM.from_config(tiny_config(tf.CONFIG_MAPPING["lfm2"]))
    raise ValueError(family)
