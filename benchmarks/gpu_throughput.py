"""Tokens/s and MFU of a patched training step on one GPU, per memory preset and length.

Where it sits: end to end over `patch()` on CUDA (ops/usp -> ops/kernels -> ops/backends,
integrations/memory for the presets). A model of Llama-3.1-8B's layer widths (hidden 4096,
MLP 14336, 32 query / 8 KV heads of 128, vocabulary 128256) with `--layers` decoder layers
(default 2), random weights in bf16, runs forward + backward on `--tokens` random tokens
(one document) under each preset of `--presets`; each configuration runs in its own
subprocess (an out-of-memory ends only that row) with a timeout. The row prints the best of
`--repeat` timed steps after one untimed step, tokens/s, the peak allocated GPU memory, and MFU:
model FLOPs / (step seconds x `--peak-tflops`), model FLOPs = 6 (N_layers + N_head) T
+ 6 L H D T^2 (causal attention, forward + backward; the input embedding is a lookup and
is not counted; a tied head counts once): this project's strict count, printed beside
torchtitan's (the whole attention square) and Megatron-DeepSpeed's (the whole square, and the
recompute under checkpointing) for comparison with published figures (capacity/mfu.py).
`--shape 1b` uses Llama-3.2-1B's widths (16 layers by default), the shape of the README's
earlier H100 record.

A preset may carry patch() keywords: `max+keep` is memory="max" with keep_attention=True (the
attention's output and LSE kept on the host, no attention recompute); `--knobs JSON` adds
patch() keywords to every row (e.g. '{"inputs_on_device": 1}').

`--profile PRESET:TOKENS` also runs one step under torch.profiler and prints CUDA time per
kernel class (GEMM, attention, elementwise/reduction, copies, other) and the top kernels:
the measured counterpart of the step-time model's breakdown (benchmarks/gpu_model.py).

Run: python benchmarks/gpu_throughput.py [--tokens 32768 131072] [--presets off balanced high max max+keep]
     [--layers 2] [--shape 8b|1b] [--repeat 2] [--profile max:32768] [--json OUT.json]
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

_RESULT = "GPU_THROUGHPUT_ROW "
SHAPES = {
    # (hidden, intermediate, heads, kv heads, head dim, vocab, tied, default layers)
    "8b": (4096, 14336, 32, 8, 128, 128256, False, 2),
    "1b": (2048, 8192, 32, 8, 64, 128256, True, 16),
}


def config(shape: str, layers: int):
    from transformers import LlamaConfig

    hidden, inter, heads, kv, head_dim, vocab, tied, _ = SHAPES[shape]
    return LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, vocab_size=vocab,
                       max_position_embeddings=1 << 22, rope_theta=500000.0, tie_word_embeddings=tied)


def model_flops(cfg, tokens: int) -> float:
    """6 (N_layers + N_head) T + 6 L H D T^2: dense GEMMs forward + backward, and causal
    attention (QK^T and PV, half the square) forward + backward."""
    h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    head = h * cfg.vocab_size
    return 6 * (L * per_layer + head) * tokens + 6 * L * q * tokens * tokens


# a row name -> (memory preset, more patch() keywords); "chunked": balanced's chunked MLP, the loss chunks from --knobs
PRESET_KWARGS = {"max+keep": ("max", {"keep_attention": True}), "chunked": (None, {"mlp_chunks": "auto"})}


def _build(shape: str, layers: int, preset: str, knobs: dict | None = None):
    from transformers import LlamaForCausalLM

    from hf_longctx import init_sequence_parallel, patch

    cfg = config(shape, layers)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(dtype=torch.bfloat16)
    mesh = init_sequence_parallel()
    named = (knobs or {}).get("attention_backend") or ""
    if named.startswith("torch_flash["):  # torch's process-wide FA3/FA4 switch, made in this row's own process
        torch.nn.attention.activate_flash_attention_impl(named[len("torch_flash["):-1])
    memory, extra = PRESET_KWARGS.get(preset, (preset, {}))
    return patch(model, mesh, memory=memory, **extra, **(knobs or {})), mesh


def _step(model, mesh, tokens: int) -> float:
    from hf_longctx import shard_batch

    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device="cuda")
    batch = shard_batch({"input_ids": ids, "labels": ids}, mesh)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model(**batch).loss.backward()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return seconds


def kernel_class(name: str) -> str:
    n = name.lower()
    if "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if any(k in n for k in ("gemm", "cutlass", "xmma", "nvjet", "sm90_", "cublas", "matmul")):
        return "gemm"
    if "memcpy" in n or "memset" in n:
        return "copy"
    if any(k in n for k in ("elementwise", "reduce", "vectorized", "softmax", "norm", "cat", "index", "scatter",
                            "gather", "fill", "copy")):
        return "elementwise/reduction"
    return "other"


def _profile(model, mesh, tokens: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _step(model, mesh, tokens)
    kernels: dict[str, list[float]] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(evt.name, [0.0, 0])
            entry[0] += evt.device_time / 1e6  # seconds (device_time is in microseconds)
            entry[1] += 1
    classes: dict[str, list[float]] = {}
    for name, (sec, calls) in kernels.items():
        c = classes.setdefault(kernel_class(name), [0.0, 0])
        c[0] += sec
        c[1] += calls
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25]
    return {"classes": classes, "top": [(n[:110], s, c) for n, (s, c) in top]}


def _row_main(shape: str, layers: int, preset: str, tokens: int, repeat: int, profile: bool, knobs: dict) -> None:
    torch.cuda.reset_peak_memory_stats()
    row = {"shape": shape, "layers": layers, "preset": preset, "tokens": tokens}
    try:
        model, mesh = _build(shape, layers, preset, knobs)
        _step(model, mesh, tokens)
        seconds = min(_step(model, mesh, tokens) for _ in range(repeat))
        row.update(fits=True, seconds=seconds, peak_gib=torch.cuda.max_memory_allocated() / 2**30)
        if profile:
            row["profile"] = _profile(model, mesh, tokens)
    except torch.OutOfMemoryError:
        row.update(fits=False)
    print(_RESULT + json.dumps(row), flush=True)


def run_row(shape: str, layers: int, preset: str, tokens: int, repeat: int, profile: bool, timeout: float,
            knobs: str = "{}") -> dict:
    root = Path(os.environ.get("HF_LONGCTX_ROOT", Path(__file__).resolve().parents[1]))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--row", shape, str(layers), preset, str(tokens),
           "--repeat", str(repeat), "--knobs", knobs] + (["--profile-row"] if profile else [])
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"shape": shape, "layers": layers, "preset": preset, "tokens": tokens, "fits": None,
                "error": f"TIMED OUT after {timeout:g} s"}
    lines = [ln[len(_RESULT):] for ln in proc.stdout.splitlines() if ln.startswith(_RESULT)]
    if not lines:
        return {"shape": shape, "layers": layers, "preset": preset, "tokens": tokens, "fits": None,
                "error": f"exit {proc.returncode}: {proc.stdout[-1500:]}"}
    return json.loads(lines[-1])


def _other_counts(cfg, row: dict, peak_tflops: float) -> str:
    """The row's MFU by torchtitan's and Megatron-DeepSpeed's counts (capacity/mfu.py)."""
    from hf_longctx.capacity.mfu import MEGATRON_DEEPSPEED, TORCHTITAN, by_convention
    from hf_longctx.data.model_dims import ModelDims

    checkpointed = row["preset"].split("+")[0] in ("high", "max")
    f = by_convention(ModelDims.from_config(cfg), row["tokens"], checkpointed=checkpointed)
    pct = {k: 100 * v / row["seconds"] / (peak_tflops * 1e12) for k, v in f.items()}
    return f"torchtitan's count {pct[TORCHTITAN]:.1f} %, Megatron-DeepSpeed's {pct[MEGATRON_DEEPSPEED]:.1f} %"


def print_row(row: dict, peak_tflops: float) -> None:
    head = f"{row['shape']:>3} L={row['layers']:<2} {row['preset']:<9} {row['tokens']:>8}"
    if row.get("fits"):
        cfg = config(row["shape"], row["layers"])
        mfu = model_flops(cfg, row["tokens"]) / row["seconds"] / (peak_tflops * 1e12)
        print(f"{head}  {row['seconds']:8.3f} s  {row['tokens'] / row['seconds']:10.0f} tok/s  "
              f"MFU {100 * mfu:5.1f} % strict ({_other_counts(cfg, row, peak_tflops)})  peak {row['peak_gib']:6.1f} GiB",
              flush=True)
    else:
        print(f"{head}  {row.get('error', 'out of memory')}", flush=True)
    prof = row.get("profile")
    if prof:
        total = sum(s for s, _ in prof["classes"].values())
        for cls, (sec, calls) in sorted(prof["classes"].items(), key=lambda kv: -kv[1][0]):
            print(f"      {cls:<24}{sec:8.3f} s  {100 * sec / total:5.1f} %  {calls:6d} kernels")
        for name, sec, calls in prof["top"][:12]:
            print(f"        {sec:8.4f} s {calls:5d}x  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1 << 15, 1 << 17])
    parser.add_argument("--presets", nargs="+", default=["off", "balanced", "high", "max"])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="H100/H200 SXM bf16 dense")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per configuration")
    parser.add_argument("--profile", default=None, metavar="PRESET:TOKENS")
    parser.add_argument("--json", default=None, help="also write every row here")
    parser.add_argument("--knobs", default="{}", help="JSON of more patch() keywords for every row")
    parser.add_argument("--row", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--profile-row", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: nothing to measure")
    if args.row:
        shape, layers, preset, tokens = args.row
        _row_main(shape, int(layers), preset, int(tokens), args.repeat, args.profile_row, json.loads(args.knobs))
        return
    layers = args.layers or SHAPES[args.shape][-1]
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  shape {args.shape}  layers {layers}")
    rows = []
    for tokens in args.tokens:
        for preset in args.presets:
            rows.append(run_row(args.shape, layers, preset, tokens, args.repeat, False, args.timeout, args.knobs))
            print_row(rows[-1], args.peak_tflops)
    if args.profile:
        preset, tokens = args.profile.split(":")
        rows.append(run_row(args.shape, layers, preset, int(tokens), 1, True, args.timeout, args.knobs))
        print_row(rows[-1], args.peak_tflops)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
