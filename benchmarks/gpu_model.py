"""The step-time model against every GPU measurement we hold, and the throughput table it gives.

Where it sits: the benchmark of `hf_longctx/capacity/step_time.py` (inventory
`capacity/inventory.py`, roofline `capacity/roofline.py`, constants `capacity/gpus.py`).
Nothing runs on a GPU here. Sections (all by default, or the flags):

  --backtest   predicted vs measured seconds, tokens/s and MFU of the README's H100 record
               (Llama-3.2-1B widths, 16 layers, memory='max', 32K) and of the nine H200 rows
               of benchmarks/results/gpu_throughput_*_h200.json (held out: no constant of the
               model is fitted to a step time), with the breakdown and what binds;
  --stream     the inventory against the op stream a real patched step records on CPU
               (`benchmarks/_op_stream.py`, emulated CUDA path), per memory preset: launches,
               FLOPs, HBM / PCIe bytes -- rerun after a hot-path change to see what moved;
  --derive     the achieved fractions of `capacity/gpus.py` from the H200 profiles' kernel
               times and the work the inventory of the profiled code counts for the same
               kernels (`gpu_derive.py`), and whether gpus.py holds what they give;
  --table      tokens/s and MFU per GPU for Llama-3.1-8B widths at 32K, 128K and 1M tokens on
               1 and 8 H100s per memory preset, beside TRL's and FPDT's published figures,
               with the targets.

    PYTHONPATH=. python benchmarks/gpu_model.py [--backtest] [--stream] [--derive] [--table]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu_throughput import config as throughput_config  # noqa: E402
from hf_longctx.capacity.cluster import Cluster  # noqa: E402
from hf_longctx.capacity.estimate import ModelDims  # noqa: E402
from hf_longctx.capacity.search import preset_setting, rank_settings  # noqa: E402
from hf_longctx.capacity.step_time import shape_of, step_time  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# (card, shape, layers, preset, tokens, measured seconds, source)
MEASURED = [
    ("h100", "1b", 16, "max", 32768, 32768 / 11927, "README 'GPU', H100 80GB HBM3, 2026-11-26"),
    *[("h200", r["shape"], r["layers"], r["preset"], r["tokens"], r["seconds"], "gpu_throughput_*_h200.json")
      for f in ("gpu_throughput_8b_h200.json", "gpu_throughput_1b_h200.json")
      for r in json.loads((RESULTS / f).read_text()) if r.get("fits") and "profile" not in r],
]
G = 2**30


def _dedupe(rows):
    """Best (lowest) time per (card, shape, layers, preset, tokens): the JSON holds repeats."""
    best = {}
    for row in rows:
        key = row[:5]
        if key not in best or row[5] < best[key][5]:
            best[key] = row
    return list(best.values())


def backtest() -> None:
    print("Backtest: one GPU, one document, forward + backward (no optimizer step); model vs measured")
    print("| card | widths | layers | memory | tokens | measured s | model s | model / measured | measured tok/s | "
          "model tok/s | measured MFU | model MFU | FLOPs s | HBM s | launch s | kernels | binds |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for card, shape, layers, preset, tokens, seconds, _ in _dedupe(MEASURED):
        dims = ModelDims.from_config(throughput_config(shape, layers))
        b = step_time(dims, preset_setting(1, 1, 1, preset, dims), Cluster(1, 80 * G, 2048 * G, gpu=card), tokens)
        measured_mfu = b.model_flops / (seconds * b.gpu.bf16_flops)
        print(f"| {card.upper()} | {shape.upper()} | {layers} | {preset} | {tokens} | {seconds:.3f} | {b.seconds:.3f} | "
              f"{b.seconds / seconds:.2f} | {tokens / seconds:,.0f} | {tokens / b.seconds:,.0f} | {100 * measured_mfu:.1f} % | "
              f"{100 * b.mfu:.1f} % | {b.flops:.3f} | {b.hbm:.3f} | {b.launches:.3f} | {b.kernels:,.0f} | {b.binds} |")


def stream() -> None:
    """The inventory against the recorded stream (tiny Llama, 40 tokens, 2 layers, chunk counts
    forced to 3 so every chunked path runs)."""
    import dataclasses

    from benchmarks._op_stream import fake_world, llama, record
    from hf_longctx.capacity.inventory import Shape, step_inventory
    from hf_longctx.capacity.op_cost import Tally
    from hf_longctx.distributed.mesh import init_sequence_parallel

    dims = dict(hidden=48, intermediate=80, heads=4, kv_heads=2, head_dim=8, vocab=112)
    cases = [("off", {}, {}), ("balanced", {"mlp_chunks": 3, "loss_chunks": 3}, {"mlp_chunks": 3, "loss_chunk": 14}),
             ("high", {"mlp_chunks": 3, "loss_chunks": 3, "checkpoint": "attention"},
              {"mlp_chunks": 3, "loss_chunk": 14, "checkpoint": "attention"}),
             ("max", {"mlp_chunks": 3, "loss_chunks": 3, "checkpoint": True},
              {"mlp_chunks": 3, "loss_chunk": 14, "checkpoint": True}),
             ("max+keep", {"mlp_chunks": 3, "loss_chunks": 3, "checkpoint": True, "keep_attention": True},
              {"mlp_chunks": 3, "loss_chunk": 14, "checkpoint": True, "keep_attention": True})]
    print("\nInventory vs recorded op stream (one rank, CUDA path emulated; Llama 48/80 wide, 40 tokens, 2 layers)")
    print("| memory | quantity | recorded | inventory | equal |")
    print("|---|---|---|---|---|")
    with fake_world(1):
        mesh = dataclasses.replace(init_sequence_parallel(1, 1), fpdt_chunks=1)
        for name, options, knobs in cases:
            got = Tally.of(record(llama(layers=2, **dims), mesh, options, 40)).as_dict()
            want = Tally.of(step_inventory(Shape(**dims, rows=40, **knobs), 2)).as_dict()
            for k in sorted(set(got) | set(want)):
                a, b = got.get(k, 0.0), want.get(k, 0.0)
                print(f"| {name} | {k} | {a:,.0f} | {b:,.0f} | {'yes' if abs(a - b) <= 1e-9 * max(1.0, a) else 'NO'} |")


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag in ("backtest", "stream", "derive", "table"):
        p.add_argument(f"--{flag}", action="store_true")
    args = p.parse_args(argv)
    every = not any(vars(args).values())
    if args.backtest or every:
        backtest()
    if args.derive or every:
        from benchmarks.gpu_derive import print_derivation

        print_derivation()
    if args.table or every:
        from benchmarks.gpu_model_table import table

        table()
    if args.stream or every:
        stream()


if __name__ == "__main__":
    main(sys.argv[1:])
