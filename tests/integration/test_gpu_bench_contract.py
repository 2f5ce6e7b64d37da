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

    rows = dict(gpu_longctx.run(layers=2, max_tokens=1 << 16, probe=probe, longest_search=lambda budget: []))
    assert rows["longest trainable context, sdpa + HF checkpointing (2 layers)"] == "32768 tokens"
    assert rows["tokens/s at 32K, memory='max' (2 layers)"] == f"{32768 / 2.0:.0f}"
    limits["sdpa+ckpt"] = 10**9
    rows = dict(gpu_longctx.run(layers=2, max_tokens=1 << 16, probe=probe, longest_search=lambda budget: []))
    assert rows["longest trainable context, sdpa + HF checkpointing (2 layers)"].startswith("65536 tokens (the --max-tokens")


def test_longest_search_starts_at_the_planners_length_and_stays_in_budget():
    """`benchmarks/gpu_longest.py` with a fake GPU of 78 GiB free and 128 GiB of host: the first
    probe is the planner's length; it fits, so the search goes up until it does not (on the GPU,
    or refused by the runtime host check, said as such); a probe that runs out of time ends it
    with that said."""
    from benchmarks import gpu_longest

    G = 2**30
    planned, u, _ = gpu_longest.planned(78 * G, 128 * G, 2, 1 << 26)
    assert planned >= 2 << 20 and planned % gpu_longest.QUANTUM == 0 and u in (2, 4, 8, 16, 32, 64)
    asked = []

    def child(args, timeout, limit=int(planned * 1.2)):
        if args[0] == "query":
            return {"free": 78 * G, "host": 128 * G}
        asked.append(int(args[1]))
        return {"fits": int(args[1]) <= limit, "seconds": 1.0, "peak": 70 * G}

    rows = dict(gpu_longest.longest_rows(150, child=child))
    assert asked[0] == planned and max(asked) > planned
    measured = rows[f"measured longest context, memory='max' (FPDT {u} chunks)"]
    assert measured.startswith("fits at ") and ", not at " in measured and "host memory" not in measured

    def host_refuses(args, timeout):  # the runtime host check refuses anything past the planner's length
        if args[0] == "query":
            return {"free": 78 * G, "host": 128 * G}
        fits = int(args[1]) <= planned
        return {"fits": fits, "seconds": 1.0, "peak": 70 * G} if fits else {"fits": False, "host": True}

    measured = dict(gpu_longest.longest_rows(150, child=host_refuses))[
        f"measured longest context, memory='max' (FPDT {u} chunks)"]
    assert measured.startswith(f"fits at {planned}, not at ") and "(host memory: the runtime check refuses it)" in measured

    def slow(args, timeout):
        return {"free": 78 * G, "host": 128 * G} if args[0] == "query" else None

    rows = dict(gpu_longest.longest_rows(150, child=slow))
    assert "stopped by the 150 s budget" in rows[f"measured longest context, memory='max' (FPDT {u} chunks)"]
