"""benchmarks/gpu_longctx.py's step on CPU: the same calls the GPU benchmark makes (a patched
model takes its batch through shard_batch, the plain one does not), on a tiny Llama, so a
wiring error fails in CI instead of on the first GPU machine (it once called the patched
model without shard_batch)."""

from __future__ import annotations

import torch


def test_gpu_benchmark_step_runs_patched_and_plain():
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks import gpu_longctx
    from hf_longctx import init_sequence_parallel, unpatch

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg)
    mesh = init_sequence_parallel()
    gpu_longctx.memory_max(model, mesh)
    try:
        assert gpu_longctx.step(model, mesh, 64) > 0
        assert all(p.grad is None for p in model.parameters())  # cleared after every probe
    finally:
        unpatch(model)
    assert gpu_longctx.step(model, None, 64) > 0
