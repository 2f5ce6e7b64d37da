"""The longest trainable context on this GPU with memory="max", measured beside the planner's
estimate for the same shape, in bounded time (`make gpu-check`).

Where it sits: `benchmarks/gpu_longctx.run` calls `longest_rows`; every step runs in a fresh
interpreter (`--probe`), killed when the time budget runs out.

The probe model: Llama-3.2-1B's widths (hidden 2048, MLP 8192, vocab 128256, 32 / 8 heads of
64) with `--layers` (default 2) decoder layers and a sliding window of 4096 tokens (Mistral's
attention). Under memory="max" the device memory per token is set by the hidden width (the
layer input, the gradient through the layer, the next layer's prefetched input: three vectors
of 4 KiB per token) and FPDT's chunks, not by the number of layers (their inputs go to the
host); the window keeps the attention's work linear in the length, so a step at millions of
tokens takes tens of seconds rather than hours.

Steps: (1) a probe reports the GPU's free memory and the node's; (2) the planner
(`capacity/budget.step_budget`, plus the bf16 weights and gradients: the step is a forward and
a backward without an optimizer) gives the longest length whose estimated peak fits the free
memory and whose host offloads fit the node (the runtime check of `integrations/host_budget.py`),
and the FPDT chunks for it; (3) a probe at that length, then a bisection (down when it does not
fit -- on the GPU, or on the host by the runtime check of `HostMemoryExceeded` -- up when it does)
while the budget lasts. Rows: the measured bracket, the planner's length,
their ratio.

Run: python -m benchmarks.gpu_longest [--budget 150] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

WINDOW = 4096
QUANTUM = 65536  # lengths are multiples of this (and of every FPDT chunk count up to 64)
BUDGET_S = 150.0  # default wall-clock bound of the whole search (3 minutes with the planning)
_RESULT = "GPU_LONGEST_PROBE "


def probe_config(layers: int = 2):
    from transformers import MistralConfig

    return MistralConfig(  # Llama-3.2-1B's widths, a sliding window, no weights needed
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=1 << 25,
        rope_theta=500000.0, sliding_window=WINDOW, tie_word_embeddings=True, torch_dtype="bfloat16",
    )


def planned(free: float, host: float, layers: int, cap: int) -> tuple[int, int, float]:
    """(tokens, FPDT chunks, estimated peak bytes) of the planner's longest length on one GPU
    with `free` device bytes and `host` bytes of node memory."""
    from hf_longctx.integrations.host_budget import HEADROOM
    from hf_longctx.capacity.budget import step_budget
    from hf_longctx.capacity.estimate import ModelDims
    from hf_longctx.capacity.search import preset_setting

    dims = ModelDims.from_config(probe_config(layers))
    weights = 4 * dims.params  # bf16 parameters and their bf16 gradients
    best = (0, 1, 0.0)
    for u in (2, 4, 8, 16, 32, 64):
        setting = preset_setting(1, 1, u, "max", dims)
        lo, hi = 0, cap // QUANTUM
        while lo < hi:  # largest multiple of QUANTUM that fits both
            mid = (lo + hi + 1) // 2
            b = step_budget(dims, setting, tokens=mid * QUANTUM)
            if weights + b.device <= free and b.host <= host * (1 - HEADROOM):
                lo = mid
            else:
                hi = mid - 1
        if lo * QUANTUM > best[0]:
            best = (lo * QUANTUM, u, weights + step_budget(dims, setting, tokens=lo * QUANTUM).device)
    return best


def _child(args: list[str], timeout: float) -> dict | None:
    """Run `--probe ...` in a fresh interpreter; None when it ran out of time."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    try:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_longest", "--probe", *args], cwd=root, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        return None
    lines = [line[len(_RESULT):] for line in proc.stdout.splitlines() if line.startswith(_RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"gpu_longest probe {args} exited {proc.returncode}:\n{proc.stdout[-4000:]}")
    return json.loads(lines[-1])


def _probe_main(what: str, tokens: int, fpdt: int, layers: int) -> None:
    from benchmarks.gpu_longctx import is_cuda_oom, step
    from hf_longctx import init_sequence_parallel, patch
    from hf_longctx.integrations.host_budget import HostMemoryExceeded, node_memory

    if what == "query":
        free, _ = torch.cuda.mem_get_info()
        print(_RESULT + json.dumps({"free": free, "host": node_memory()}), flush=True)
        return
    from transformers import MistralForCausalLM

    with torch.device("cuda"):
        model = MistralForCausalLM(probe_config(layers)).to(dtype=torch.bfloat16)
    mesh = init_sequence_parallel(1, 1, fpdt_chunks=fpdt)
    patch(model, mesh, memory="max")
    model.train()
    torch.cuda.reset_peak_memory_stats()
    try:
        seconds = step(model, mesh, tokens)
        result = {"fits": True, "seconds": seconds, "peak": torch.cuda.max_memory_allocated()}
    except HostMemoryExceeded:  # the runtime host check refused it before any offload
        result = {"fits": False, "seconds": None, "peak": None, "host": True}
    except Exception as exc:  # noqa: BLE001 -- anything but an OOM fails the probe
        if not is_cuda_oom(exc):
            raise
        result = {"fits": False, "seconds": None, "peak": None}
    print(_RESULT + json.dumps(result), flush=True)


def longest_rows(budget_s: float = BUDGET_S, layers: int = 2, cap: int = 1 << 26, child=_child) -> list[tuple[str, str]]:
    """The rows of the bounded search (see the module docstring)."""
    start = time.monotonic()
    left = lambda: budget_s - (time.monotonic() - start)  # noqa: E731
    info = child(["query", "0", "1", str(layers)], left())
    if info is None:
        return [("longest context, memory='max'", f"not measured: the GPU query ran past the {budget_s:.0f} s budget")]
    tokens, u, peak = planned(info["free"], info["host"], layers, cap)
    shape = f"Llama-3.2-1B widths, {layers} layers, window {WINDOW}"
    rows = [(f"planner's longest context, memory='max' ({shape})",
             f"{tokens} tokens (FPDT {u} chunks, estimated peak {peak / 2**30:.1f} GiB of {info['free'] / 2**30:.1f} "
             f"GiB free)")]
    lo, hi, timed_out, last, host_bound = 0, None, False, None, False
    probe_at = tokens
    while probe_at >= QUANTUM and (hi is None or hi - lo > QUANTUM):
        got = child(["max", str(probe_at), str(u), str(layers)], left())
        if got is None:
            timed_out = True
            break
        if got["fits"]:
            lo, last = probe_at, got
            probe_at = (probe_at + hi) // 2 // QUANTUM * QUANTUM if hi else probe_at + max(QUANTUM, probe_at // 4 // QUANTUM * QUANTUM)
        else:
            hi, host_bound = probe_at, bool(got.get("host"))
            probe_at = (lo + hi) // 2 // QUANTUM * QUANTUM
        if probe_at <= lo or (hi is not None and probe_at >= hi):
            break
    bracket = f"fits at {lo}" + (f", not at {hi}" + (" (host memory: the runtime check refuses it)" if host_bound
                                                      else "") if hi else ", longer not tried")
    why = f"; stopped by the {budget_s:.0f} s budget" if timed_out else ""
    measured = f"{bracket} tokens{why}" + (f" ({last['seconds']:.1f} s per step, peak "
                                          f"{last['peak'] / 2**30:.1f} GiB)" if last else "")
    rows.append((f"measured longest context, memory='max' (FPDT {u} chunks)", measured))
    rows.append(("measured / planned longest context", f"{lo / tokens:.2f} (>=)" if tokens and not hi else
                 f"{lo / tokens:.2f} .. {hi / tokens:.2f}" if tokens else "n/a"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole search")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--probe", nargs=4, metavar=("WHAT", "TOKENS", "FPDT", "LAYERS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: nothing to measure")
    if args.probe:
        what, tokens, fpdt, layers = args.probe
        _probe_main(what, int(tokens), int(fpdt), int(layers))
        return
    for name, value in longest_rows(args.budget, args.layers):
        print(f"{name:<70}{value}")


if __name__ == "__main__":
    main()
