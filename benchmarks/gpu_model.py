"""The step-time model against every GPU measurement we hold, and the throughput table it gives.

Where it sits: the benchmark of `hf_longctx/capacity/step_time.py` (inventory
`capacity/inventory.py`, roofline `capacity/roofline.py`, constants `capacity/gpus.py`).
Nothing runs on a GPU here. Sections (all by default, or the flags):

  --backtest   every result file of benchmarks/results/ (`gpu_results.py`'s naming rule): per
               measured row, the model of the code that run measured and its error, the model
               of the code as it is, MFU by three counts, in- or out-of-sample; every
               prediction committed before its run with its error (`gpu_backtest.py`);
  --stream     the inventory against the op stream a real patched step records on CPU
               (`benchmarks/_op_stream.py`, emulated CUDA path), per memory preset: launches,
               FLOPs, HBM / PCIe bytes -- rerun after a hot-path change to see what moved;
  --derive     the achieved fractions of `capacity/gpus.py` from the H200 profiles' kernel
               times and the work the inventory of the profiled code counts for the same
               kernels (`gpu_derive.py`), and whether gpus.py holds what they give;
  --table      tokens/s and MFU per GPU for Llama-3.1-8B widths at 32K, 128K and 1M tokens on
               1 and 8 H100s per memory preset, beside TRL's and FPDT's published figures,
               with the targets;
  --targets    the targets alone (`gpu_targets.py`): 8B `max` + keep_attention at 128K on one
               H100 (strict MFU >= 45 %), one 1M-token sequence on 8 H100s (<= 266 s), with the
               flash-attn fractions measured here and with FlashAttention-3-class ones assumed.

Before a GPU run, `predict_rows` / `write_predictions` store what the model predicts, and
`record_run` the measurements beside them afterwards (`gpu_predictions.py`).

    PYTHONPATH=. python benchmarks/gpu_model.py [--backtest] [--stream] [--derive] [--table] [--targets]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu_backtest import print_backtest  # noqa: E402
from benchmarks.gpu_predictions import predict_rows, record_run, write_predictions  # noqa: E402,F401 (the API)


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
    for flag in ("backtest", "stream", "derive", "table", "targets"):
        p.add_argument(f"--{flag}", action="store_true")
    args = p.parse_args(argv)
    every = not any(vars(args).values())
    if args.backtest or every:
        print_backtest()
    if args.derive or every:
        from benchmarks.gpu_derive import print_derivation

        print_derivation()
    if args.table or every:
        from benchmarks.gpu_model_table import table

        table()
    elif args.targets:
        from benchmarks.gpu_targets import print_targets

        print_targets()
    if args.stream or every:
        stream()


if __name__ == "__main__":
    main(sys.argv[1:])
