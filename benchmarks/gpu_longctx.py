"""GPU benchmark for `make gpu-check`: a Llama-3.2-1B-shaped model in bf16 on one GPU.

Where it sits: end to end over `patch()` (ops/usp -> ops/kernels -> ops/backends on CUDA).
Measures (1) the longest context a training step (forward + backward) fits with our
memory preset "max" and with plain sdpa + gradient checkpointing (HF's own), by doubling
then bisecting to a multiple of 4K tokens; (2) tokens/s and MFU of our step at 128K
tokens (MFU = model FLOPs / (step time x peak bf16 dense FLOP/s), model FLOPs =
6·N·T + 6·L·H·D·T² (causal attention, forward + backward)).

Run: python benchmarks/gpu_longctx.py [--layers 16] [--max-tokens 1048576] [--peak-tflops 989]
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from hf_longctx import init_sequence_parallel, patch, shard_batch


def llama_1b_config(layers: int = 16):
    from transformers import LlamaConfig

    return LlamaConfig(  # meta-llama/Llama-3.2-1B's shapes (no weights needed)
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=1 << 21,
        rope_theta=500000.0, tie_word_embeddings=True, torch_dtype="bfloat16",
    )


def memory_max(model, mesh):
    """Our most memory-frugal setting: the "max" preset (chunked LM head + loss, chunked MLP,
    checkpointing with offloaded inputs, KV offload when the mesh has FPDT chunks)."""
    return patch(model, mesh, memory="max")


def build(mode: str, layers: int):
    """(model on the GPU, its SP mesh for "ours" / None for plain sdpa + checkpointing)."""
    from transformers import LlamaForCausalLM

    cfg = llama_1b_config(layers)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16)
    if mode == "ours":
        mesh = init_sequence_parallel()
        return memory_max(model, mesh), mesh
    model.gradient_checkpointing_enable()
    return model, None


def step(model, mesh, tokens: int) -> float:
    """Seconds of one forward + backward on `tokens` random tokens; a patched model (mesh
    given) takes its batch through `shard_batch`, as every patched model must."""
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    batch = {"input_ids": ids, "labels": ids}
    if mesh is not None:
        batch = shard_batch(batch, mesh)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        model(**batch).loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0
    finally:
        model.zero_grad(set_to_none=True)  # also after an OOM in backward: later probes start clean


def fits(model, mesh, tokens: int) -> bool:
    try:
        step(model, mesh, tokens)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        gc.collect()
        torch.cuda.empty_cache()


def longest(model, mesh, cap: int, quantum: int = 4096) -> int:
    lo, hi = 0, quantum
    while hi <= cap and fits(model, mesh, hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cap + quantum)
    while hi - lo > quantum:
        mid = (lo + hi) // 2 // quantum * quantum
        lo, hi = (mid, hi) if fits(model, mesh, mid) else (lo, mid)
    return lo


def mfu(model, tokens: int, seconds: float, peak_tflops: float) -> float:
    cfg = model.config
    n = sum(p.numel() for p in model.parameters())
    attn = 6 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * tokens * tokens
    return (6 * n * tokens + attn) / seconds / (peak_tflops * 1e12)


def run(layers: int = 16, max_tokens: int = 1 << 20, at: int = 131072, peak_tflops: float = 989.0) -> list[tuple[str, str]]:
    rows = []
    lengths = {}
    for mode in ("sdpa+ckpt", "ours"):
        model, mesh = build("sdpa" if mode == "sdpa+ckpt" else "ours", layers)
        lengths[mode] = longest(model, mesh, max_tokens)
        rows.append((f"longest trainable context, {mode}", f"{lengths[mode]} tokens"))
        if mode == "ours":
            if lengths[mode] >= at:
                step(model, mesh, at)
                seconds = min(step(model, mesh, at) for _ in range(2))
                rows.append((f"tokens/s at {at // 1024}K, ours", f"{at / seconds:.0f}"))
                rows.append((f"MFU at {at // 1024}K, ours (peak {peak_tflops:.0f} TFLOP/s)", f"{100 * mfu(model, at, seconds, peak_tflops):.1f}%"))
            else:
                rows.append((f"tokens/s at {at // 1024}K, ours", "does not fit"))
        del model
        gc.collect()
        torch.cuda.empty_cache()
    ratio = lengths["ours"] / max(1, lengths["sdpa+ckpt"])
    rows.append(("context ratio ours / sdpa+ckpt (goal >= 16x)", f"{ratio:.1f}x"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=1 << 20)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="H100 SXM bf16 dense")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: nothing to measure")
    for name, value in run(args.layers, args.max_tokens, peak_tflops=args.peak_tflops):
        print(f"{name:<60}{value}")


if __name__ == "__main__":
    main()
