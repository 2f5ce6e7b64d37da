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


def test_both_cuda_oom_forms_count_as_not_fitting_and_nothing_else_does():
    from benchmarks import gpu_longctx

    assert gpu_longctx.is_cuda_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert gpu_longctx.is_cuda_oom(RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be ..."))
    assert not gpu_longctx.is_cuda_oom(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not gpu_longctx.is_cuda_oom(ValueError("out of memory"))


def test_longest_is_bounded_and_finds_the_threshold():
    from benchmarks import gpu_longctx

    asked = []

    def fits_below(limit):
        def fits(tokens):
            asked.append(tokens)
            return tokens <= limit
        return fits

    assert gpu_longctx.longest(fits_below(10**9), cap=1 << 18, quantum=8192) == 1 << 18
    assert max(asked) == 1 << 18  # never probes past the bound
    asked.clear()
    assert gpu_longctx.longest(fits_below(100_000), cap=1 << 18, quantum=8192) == 98304
    assert max(asked) <= 1 << 18
    assert gpu_longctx.longest(fits_below(200_000), cap=250_000, quantum=8192) == 196608
    assert gpu_longctx.longest(fits_below(10), cap=1 << 18, quantum=8192) == 0


def test_run_table_says_what_was_bounded():
    from benchmarks import gpu_longctx

    limits = {"sdpa+ckpt": 40_000, "ours": 10**9}

    def probe(mode, tokens, layers, repeat=0):
        return {"fits": tokens <= limits[mode], "seconds": 2.0}

    rows = dict(gpu_longctx.run(layers=2, max_tokens=1 << 18, probe=probe))
    assert rows["longest trainable context, sdpa+ckpt"] == "32768 tokens"
    assert rows["longest trainable context, ours"].startswith("262144 tokens (the --max-tokens bound")
    assert "lower bound" in rows["context ratio ours / sdpa+ckpt (goal >= 16x)"]
    assert rows["tokens/s at 128K, ours"] == f"{131072 / 2.0:.0f}"
