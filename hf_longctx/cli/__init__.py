"""The `hf-longctx` command: `plan` (which mesh and `patch(memory=...)` preset to train a
model at a sequence length on a given cluster) and `step-plot` (a recorded step's figure).

Where it sits: outside the training data flow, before a job is launched. It reads the
model config (a config.json, a directory, or a name already in the local Hugging Face
cache -- never the network), ranks every setting with `capacity/search.py` and prints one
table, best first, ending with the suggestion as code (`suggest()` returns the same).
`--plot FILE.png` draws one sampled step's per-rank load (`--flex`: flexible SP groups).
  hf-longctx plan --model PATH_OR_NAME --gpus 64 --gpu-memory 80GiB --host-memory 1TiB \\
      --seq-len 131072 [--dtype bf16] [--micro-batch-tokens N] [--top 10] [--plot F [--flex]]
  hf-longctx step-plot RECORD.json --out OUT.png
This file: the parser and `step-plot`; `capacity.py` the `plan` table (`plan_flags.py` the flags
read together, `binding.py` what binds); `plots.py` the figures."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from hf_longctx.cli.capacity import cmd_plan
from hf_longctx.cli.inputs import parse_size


def cmd_step_plot(args: argparse.Namespace) -> int:
    from hf_longctx.cli import load_plot as plot

    try:
        record = json.loads(Path(args.record).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{args.record!r}: not a StepRecord JSON written by trainer.last_plan.save(...) ({e})") from None
    missing = {"step", "lengths", "groups", "slot_tokens", "microbatch_s", "measured_s"} - set(record)
    if missing:
        raise ValueError(f"{args.record!r}: missing {sorted(missing)}; write it with trainer.last_plan.save(path)")
    plot.draw_step_record(record, args.out)
    print(f"wrote {args.out}: step {record['step']}, {len(record['slot_tokens'])} slots {' '.join(record['groups'])}, "
          f"measured {record['measured_s']:.3f} s on the saving rank")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-longctx", description="hf_longctx command line tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="rank sequence-parallel settings by estimated memory and step time")
    p.add_argument("--model", required=True, help="config.json, a model directory, or a name in the local HF cache")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs (world size)")
    p.add_argument("--gpu-memory", type=parse_size, required=True, help="memory per GPU, e.g. 80GiB")
    p.add_argument("--host-memory", type=parse_size, required=True, help="host memory per node, e.g. 512GiB")
    p.add_argument("--seq-len", type=int, required=True, help="target sequence (document) length in tokens")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="tokens per SP group per micro-batch (default: --seq-len)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="micro-batches per rank and optimizer step (default 1: no gradients held between them)")
    p.add_argument("--tokens-per-step", type=int, default=None,
                   help="global tokens per optimizer step; micro-batches = this / (dp x micro-batch tokens) per setting")
    p.add_argument("--param-offload", choices=["auto", "yes", "no"], default="auto",
                   help="FSDP2 CPUOffloadPolicy (parameters, gradients, optimizer states on host): try both, force, forbid")
    p.add_argument("--cpu-optim-bw", type=parse_size, default=10e9,
                   help="per-GPU host memory bandwidth of the CPU optimizer step with parameter offload, bytes/s")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="compute dtype")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--top", type=int, default=10, help="feasible settings to show")
    p.add_argument("--show-infeasible", action="store_true", help="also list settings that do not fit, with why")
    p.add_argument("--gpus-per-node", type=int, default=8,
                   help="GPUs per node: Ulysses stays inside a node, and the node's --host-memory is shared by this many "
                        "ranks (host GiB/GPU x this must fit)")
    p.add_argument("--gpu", choices=["h100", "h200", "a100"], default="h100",
                   help="the GPU the step-time model runs on (hf_longctx/capacity/gpus.py: peaks, links, achieved "
                        "fractions per kernel class); a100: memory plans only, no kernel of it measured")
    p.add_argument("--attention-backend", default=None,
                   help="the attention kernel the step-time model runs: one measured on --gpu (capacity/gpus.py; "
                        "default: the fastest measured there, torch_flash today), as patch(attention_backend=...)")
    p.add_argument("--intra-bw", type=parse_size, default=None,
                   help="per-GPU bandwidth within a node, bytes/s per direction (default: the GPU's NVLink)")
    p.add_argument("--inter-bw", type=parse_size, default=None,
                   help="per-GPU bandwidth across nodes, bytes/s per direction (default: the GPU's NIC)")
    p.add_argument("--pcie-bw", type=parse_size, default=None,
                   help="per-GPU host<->device bandwidth, bytes/s (default: the GPU's measured PCIe)")
    p.add_argument("--latency", type=float, default=None, help="seconds per collective call (default: the GPU's)")
    p.add_argument("--headroom", type=float, default=0.1, help="fraction of GPU/host memory kept free")
    p.add_argument("--plot", default=None, help="write the per-rank load of a sampled step (PNG) for the best setting")
    p.add_argument("--lengths-file", default=None, help="document lengths for --plot: one per line or a JSON list, .gz ok")
    p.add_argument("--plot-microbatches", type=int, default=4, help="micro-batches per DP rank in the sampled step")
    p.add_argument("--flex", action="store_true",
                   help="--plot the step with flexible SP groups (sizes chosen per slot): layouts and per-rank load")
    p.add_argument("--unequal-calls", action="store_true",
                   help="memory of flexible groups with unequal micro-batch counts (parameters and gradients unsharded "
                        "for the whole step); with --flex --plot, plan the step that way")
    p.add_argument("--sync-each-microbatch", action="store_true",
                   help="memory with a gradient reduce-scatter in every micro-batch (LongContextTrainer("
                        "sync_each_microbatch=True)) instead of unsharded fp32 gradients held through the step")
    g = p.add_argument_group("vision-language models (visual content per sample of --seq-len tokens, which count it)")
    g.add_argument("--images", type=int, default=0, help="images per sample")
    g.add_argument("--image-tokens", type=int, default=0, help="language-model tokens per image")
    g.add_argument("--video-seconds", type=float, default=0.0, help="seconds of video per sample")
    g.add_argument("--fps", type=float, default=0.0, help="video frames sampled per second")
    g.add_argument("--frame-tokens", type=int, default=0, help="language-model tokens per temporal slice (two frames)")
    p.add_argument("--task", choices=["sft", "dpo", "dpo-precomputed", "grpo", "rloo"], default="sft",
                   help="the objective: dpo / grpo / rloo add the frozen reference (weights and forward) and the "
                        "chunked log-prob head (dpo-precomputed: precompute_ref_log_probs=True, the head only; "
                        "--task dpo also prints which of the two it picks); --seq-len counts a pair's or a group's "
                        "documents together")
    p.add_argument("--rollout-tokens", type=int, default=None,
                   help="grpo / rloo: prompt + completion tokens each GPU generates per step on the training GPUs, "
                        "where their trainers always generate (KV cache, the whole model gathered); >= 1, default "
                        "--seq-len")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_plan)
    q = sub.add_parser("step-plot", help="draw trainer.last_plan (saved with trainer.last_plan.save(FILE.json))")
    q.add_argument("record", help="the JSON written by StepRecord.save")
    q.add_argument("--out", required=True, help="PNG to write")
    q.set_defaults(func=cmd_step_plot)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "plan":
        _check_plan_args(parser, args)
    try:
        return args.func(args)
    except (ValueError, ImportError) as e:
        print(f"hf-longctx {args.command}: error: {e}", file=sys.stderr)
        return 2


def _check_plan_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`plan`'s numeric flags, refused by argparse (exit 2) before anything runs."""
    for name in ("gpus", "seq_len", "top", "gpus_per_node", "plot_microbatches", "microbatches", "tokens_per_step"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.micro_batch_tokens is not None and args.micro_batch_tokens < args.seq_len:
        parser.error(f"--micro-batch-tokens ({args.micro_batch_tokens}) must be >= --seq-len ({args.seq_len})")
    if args.tokens_per_step is not None and args.tokens_per_step < (args.micro_batch_tokens or args.seq_len):
        parser.error(f"--tokens-per-step ({args.tokens_per_step}) must be >= the micro-batch tokens "
                     f"({args.micro_batch_tokens or args.seq_len})")


if __name__ == "__main__":
    sys.exit(main())
