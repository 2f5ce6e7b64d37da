"""GPU benchmark for `make gpu-check`: a Llama-3.2-1B-shaped model in bf16 on one GPU.

Where it sits: end to end over `patch()` (ops/usp -> ops/kernels -> ops/backends on CUDA).
Measures (1) the longest context a training step (forward + backward) fits with memory="max",
beside the planner's estimate for the same shape (`benchmarks/gpu_longest.py`: a bisection
from the planner's length, within `--budget` seconds); (2) the longest context of plain sdpa +
HF gradient checkpointing on the 1B shape (doubling, then bisecting to a multiple of 8K, up
to `--max-tokens`); (3) tokens/s and MFU of memory="max" at 32K tokens (MFU = model FLOPs /
(step time x peak bf16 dense FLOP/s), model FLOPs = 6·N·T + 6·L·H·D·T², causal attention,
forward + backward).

Bounded: about three minutes on one H100 with the defaults. Every probe runs in its own
subprocess with a timeout (a CUDA context broken by an OOM dies with it); a probe that runs
out of time is reported as such. Both CUDA OOM forms count as "does not fit":
`torch.OutOfMemoryError` and `RuntimeError: CUDA error: out of memory`; any other failure is
an error, not a length.

Run: python benchmarks/gpu_longctx.py [--budget 150] [--layers 16] [--max-tokens 65536] [--peak-tflops 989]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

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
    with torch.device("cuda"):  # initialised on the GPU: no 5 GB fp32 host copy per probe
        model = LlamaForCausalLM(cfg).to(dtype=torch.bfloat16)
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


MAX_TOKENS = 1 << 16  # 64K: the default bound of the sdpa + checkpointing baseline's doubling
AT = 1 << 15  # tokens/s and MFU at 32K (a 16-layer 1B step takes seconds there)
QUANTUM = 8192
_RESULT = "GPU_LONGCTX_PROBE "  # prefix of the one line a probe subprocess reports on


def is_cuda_oom(exc: BaseException) -> bool:
    """Both forms a CUDA allocation failure takes: the caching allocator's
    `torch.OutOfMemoryError`, and `RuntimeError: CUDA error: out of memory` from a kernel
    launch or a library's own allocation (cuBLAS workspace, NCCL)."""
    return isinstance(exc, torch.OutOfMemoryError) or (isinstance(exc, RuntimeError) and "out of memory" in str(exc))


def fits(model, mesh, tokens: int) -> bool:
    try:
        step(model, mesh, tokens)
        return True
    except Exception as exc:  # noqa: BLE001 -- anything but an OOM propagates
        if not is_cuda_oom(exc):
            raise
        return False
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


PROBE_TIMEOUT_S = 120.0


def probe_in_subprocess(mode: str, tokens: int, layers: int, repeat: int = 0, timeout: float = PROBE_TIMEOUT_S) -> dict:
    """Run one probe (`_probe_main`) in a fresh interpreter: {"fits": bool, "seconds": float
    (best of `repeat` timed steps after the probing one, or the probing step)}. Raises
    RuntimeError naming the probe when the child fails for a reason other than an OOM, or
    runs past `timeout` seconds (then it is killed)."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "benchmarks.gpu_longctx", "--probe", mode, str(tokens), "--layers", str(layers),
           "--repeat", str(repeat)]
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"TIMED OUT after {timeout:g} s: probe {mode} at {tokens} tokens (killed)") from None
    lines = [line[len(_RESULT):] for line in proc.stdout.splitlines() if line.startswith(_RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"probe {mode} at {tokens} tokens exited {proc.returncode}:\n{proc.stdout[-4000:]}")
    return json.loads(lines[-1])


def _probe_main(mode: str, tokens: int, layers: int, repeat: int) -> None:
    model, mesh = build("sdpa" if mode == "sdpa+ckpt" else "ours", layers)
    try:
        seconds = step(model, mesh, tokens)
        if repeat:
            seconds = min(step(model, mesh, tokens) for _ in range(repeat))
        result = {"fits": True, "seconds": seconds}
    except Exception as exc:  # noqa: BLE001 -- anything but an OOM fails the probe
        if not is_cuda_oom(exc):
            raise
        result = {"fits": False, "seconds": None}
    print(_RESULT + json.dumps(result), flush=True)


def longest(fits_at: Callable[[int], bool], cap: int, quantum: int = QUANTUM) -> int:
    """Largest multiple of `quantum` <= cap for which `fits_at` holds (doubling, then
    bisecting), assuming monotonicity; 0 if even `quantum` does not fit."""
    lo, hi = 0, quantum
    while hi <= cap and fits_at(hi):
        lo, hi = hi, hi * 2
    if lo == cap or (lo and hi > cap and fits_at(cap)):  # reached the bound
        return cap
    hi = min(hi, cap)
    while hi - lo > quantum:
        mid = (lo + hi) // 2 // quantum * quantum
        lo, hi = (mid, hi) if fits_at(mid) else (lo, mid)
    return lo


def _mfu(cfg, n_params: int, tokens: int, seconds: float, peak_tflops: float) -> float:
    attn = 6 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * tokens * tokens
    return (6 * n_params * tokens + attn) / seconds / (peak_tflops * 1e12)


def mfu(model, tokens: int, seconds: float, peak_tflops: float) -> float:
    return _mfu(model.config, sum(p.numel() for p in model.parameters()), tokens, seconds, peak_tflops)


def run(layers: int = 16, max_tokens: int = MAX_TOKENS, at: int = AT, peak_tflops: float = 989.0,
        probe: Callable[..., dict] = probe_in_subprocess, budget_s: float | None = None,
        longest_search: Callable[..., list] | None = None) -> list[tuple[str, str]]:
    """The rows of `make gpu-check`'s benchmark, each part bounded: the longest context with
    memory="max" measured beside the planner's estimate (`benchmarks/gpu_longest.py`, within
    `budget_s`), the longest context of plain sdpa + HF checkpointing on the 1B shape (doubling
    up to `max_tokens`), and tokens/s and MFU of memory="max" at `at` tokens."""
    from benchmarks import gpu_longest

    rows = (longest_search or gpu_longest.longest_rows)(gpu_longest.BUDGET_S if budget_s is None else budget_s)
    base = longest(lambda t: probe("sdpa+ckpt", t, layers)["fits"], max_tokens)
    bounded = " (the --max-tokens bound; may fit more)" if base >= max_tokens else ""
    rows.append((f"longest trainable context, sdpa + HF checkpointing ({layers} layers)", f"{base} tokens{bounded}"))
    got = probe("ours", at, layers, repeat=1)
    if got["fits"]:
        rows.append((f"tokens/s at {at // 1024}K, memory='max' ({layers} layers)", f"{at / got['seconds']:.0f}"))
        n = _parameters(layers)
        rows.append((f"MFU at {at // 1024}K, memory='max' (strict count, capacity/mfu.py; "
                     f"peak {peak_tflops:.0f} TFLOP/s)",
                     f"{100 * _mfu(llama_1b_config(layers), n, at, got['seconds'], peak_tflops):.1f}%"))
    else:
        rows.append((f"tokens/s at {at // 1024}K, memory='max'", "does not fit"))
    return rows


def _parameters(layers: int) -> int:
    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        return sum(p.numel() for p in LlamaForCausalLM(llama_1b_config(layers)).parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="bound of the baseline's doubling")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the longest-context search of memory='max' (default: gpu_longest.BUDGET_S)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="H100 SXM bf16 dense")
    parser.add_argument("--probe", nargs=2, metavar=("MODE", "TOKENS"), help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: nothing to measure")
    if args.probe:
        _probe_main(args.probe[0], int(args.probe[1]), args.layers, args.repeat)
        return
    for name, value in run(args.layers, args.max_tokens, peak_tflops=args.peak_tflops, budget_s=args.budget):
        print(f"{name:<60}{value}")


if __name__ == "__main__":
    main()
