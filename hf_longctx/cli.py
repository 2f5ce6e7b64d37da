"""The `hf-longctx` command. `plan`: which (ulysses, ring, fpdt chunks) mesh and which
`patch(memory=...)` preset to train a model at a sequence length on a given cluster; the
last lines print the suggestion as code (`planning.search.suggest` returns the same).

Where it sits: outside the training data flow, before a job is launched. It reads the
model config (a config.json, a directory holding one, or a name already in the local
Hugging Face cache -- never the network), ranks every setting with `planning/search.py`
(memory from `planning/memory.py`: FPDT §3-4 memory analysis, USP §4 memory and
communication) and prints one table, best first. `--plot FILE.png` draws the per-rank load
of one sampled step planned with `plan_microbatches` for the best setting
(`planning/plot.py`); with `--flex` the step is planned with flexible SP groups instead
(`plan_flexible`, groups of every power-of-two size, FlexSP / Hydraulis): the figure shows
each slot's group layout and every rank's load, and the output names the layouts, the
per-rank busy max/mean and the modelled step against the best setting's fixed degree.

Usage:
  hf-longctx plan --model PATH_OR_NAME --gpus 64 --gpu-memory 80GiB --host-memory 1TiB \\
      --seq-len 131072 [--dtype bf16] [--micro-batch-tokens N] [--top 10] [--show-infeasible] \\
      [--plot load.png [--lengths-file lengths.txt.gz] [--flex]]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Sequence

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> float:
    """'80GiB', '80 GB', '512g', '1e9' → bytes (GiB/MiB binary, GB/G decimal); a trailing
    '/s' is allowed for bandwidths."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)(/s)?\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"cannot read size {text!r}: use e.g. 80GiB, 80GB, 512G, 25GB/s")
    try:
        value = float(m.group(1)) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read size {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return value


def load_config(model: str) -> Any:
    """A transformers config from a config.json, a directory, or a locally cached name."""
    from transformers import AutoConfig

    path = Path(model)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"--model {model!r}: not valid JSON ({e})") from None
        if "model_type" not in data:
            raise ValueError(f"--model {model!r}: config.json has no 'model_type'")
        return AutoConfig.for_model(data.pop("model_type"), **data)
    try:
        return AutoConfig.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"--model {model!r} is neither a config.json / model directory nor a name in the local Hugging Face "
            f"cache ({type(e).__name__}: {str(e).splitlines()[0]}); pass a path to its config.json"
        ) from None


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f}"


def _row(rank: int | str, c) -> list[str]:
    s, m = c.setting, c.memory
    return [str(rank), str(s.ulysses), str(s.ring), str(c.dp), str(s.fpdt_chunks), c.preset, "yes" if s.kv_offload else "no",
            "yes" if s.checkpoint else "no", "yes" if s.mlp_chunks > 1 else "no", "yes" if s.param_offload else "no",
            str(c.microbatches), _gib(m.params), _gib(m.grads + m.held), _gib(m.optimizer), _gib(m.activations), _gib(m.buffers), _gib(m.peak),
            _gib(m.host), f"{c.step_seconds:.2f}", f"{c.tokens_per_second / c.dp / c.setting.sp:,.0f}",
            "yes" if c.feasible else f"no: {c.reason}"]


HEADER = ["#", "ulysses", "ring", "dp", "fpdt", "memory", "kv offload", "ckpt", "chunked mlp/loss", "param offload",
          "micro-batches", "params", "grads",
          "optim", "activ", "buffers", "peak GiB", "host GiB/GPU", "step s", "tok/s/GPU", "fits"]


def format_table(rows: list[list[str]]) -> str:
    """A Markdown table (readable in a terminal and pasteable into an issue)."""
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]

    def line(r: list[str]) -> str:  # numbers right-aligned, the free-text "fits" column left-aligned
        return "| " + " | ".join(v.rjust(w) if i < len(HEADER) - 1 else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))) + " |"

    return "\n".join([line(HEADER), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def footer(args: argparse.Namespace) -> str:
    from hf_longctx.planning.search import TIE_TOLERANCE
    return "\n".join([
        "Assumptions (hf_longctx/planning/memory.py and search.py docstrings):",
        f"- memory per GPU in GiB; ZeRO-3 over all {args.gpus} GPUs: fp32 params, fp32 grads, {args.optimizer} "
        "states (AdamW: 2 fp32 moments) sharded; plus FSDP's gathered units (2 layers, or LM head + 1 layer) and "
        "one unit's unsharded grads in the compute dtype; "
        + ("gradients reduce-scattered in every micro-batch's backward (--sync-each-microbatch), the earlier "
           "micro-batches' sharded fp32 gradients held through the step;" if args.sync_each_microbatch
           else "with several micro-batches per step the trainer reduce-scatters in the last backward only, so the fp32 "
           "unsharded gradients (4 B/param) are held through the step (in grads; --sync-each-microbatch shards them);"),
        "- activ = what autograd keeps for a Llama-style layer at S/sp tokens per GPU (checkpointing: layer inputs, "
        "on host; FPDT+offload: q/k/v/out on host); buffers = the larger transient of the loss and of one layer's "
        "backward (all-to-all, ring, recompute); peak = params + optim + max(grads, activ + buffers);",
        *([f"- --unequal-calls: every rank holds the whole model in {args.dtype} for the step (in params) next to the "
           "held fp32 unsharded gradients, as ranks run different numbers of micro-batches "
           "(distributed/flex/unsharded_step.py);"]
          if args.unequal_calls else []),
        "- held fp32 gradients sit next to every micro-batch's activations: peak = params + optim + held + "
        "max(grads - held, activ + buffers);",
        f"- fits = peak <= (1 - {args.headroom}) x --gpu-memory and host GiB/GPU x GPUs per node <= (1 - "
        f"{args.headroom}) x --host-memory; validated within 10% on CPU (benchmarks/memory_model.py);",
        f"- step s = one micro-batch of {args.micro_batch_tokens} tokens per SP group (documents of {args.seq_len}): "
        f"CostModel.from_config FLOPs at MFU {args.mfu} of {args.tflops:g} TFLOP/s (+1/3 for checkpoint recompute, "
        "+ MLP forward for chunked MLP) + exposed Ulysses all-to-all "
        f"({args.intra_bw / 1e9:g} GB/s in a node of {args.gpus_per_node}, {args.inter_bw / 1e9:g} GB/s across, "
        f"{args.latency * 1e6:g} us per call) + "
        f"ring / FSDP / host offload ({args.pcie_bw / 1e9:g} GB/s) traffic beyond the compute they overlap;",
        "- param offload (FSDP2 CPUOffloadPolicy; --param-offload auto|yes|no): the fp32 parameter and gradient "
        "shards and the optimizer states on host (in host GiB/GPU), their PCIe traffic overlapped, the optimizer step "
        f"on the CPU at {args.cpu_optim_bw / 1e9:g} GB/s per GPU (--cpu-optim-bw), not overlapped;",
        "- micro-batches = per rank and step (--microbatches, or --tokens-per-step / (dp x micro-batch tokens)); with "
        "one, no earlier gradients are held;",
        "- best first = fits, then highest cluster tokens/s (dp x tokens / step s), then lowest peak; estimates within "
        f"{TIE_TOLERANCE:.0%} of the fastest (the cost model's measured error) are not told apart: among them the USP "
        "guidance (Ulysses inside a node, ring only across nodes) ranks first.",
    ])


def _binding_advice(args: argparse.Namespace, c) -> str:
    """Which resource rules out `c` (the setting closest to fitting) and the flags that change it."""
    usable = 1 - args.headroom
    if c.binding == "host memory":
        return (f"HOST memory binds: {_gib(c.memory.host * min(args.gpus, args.gpus_per_node))} GiB per node needed, "
                f"{_gib(args.host_memory * usable)} GiB usable of --host-memory {_gib(args.host_memory)} GiB; raise "
                "--host-memory, or offload less (--param-offload no, a lighter memory preset) with more GPU memory")
    flags = ["--gpu-memory", "more --gpus"]
    if args.param_offload == "no":
        flags.append("--param-offload auto (parameters, gradients and optimizer states on host)")
    if c.memory.held and not args.sync_each_microbatch and not args.unequal_calls:
        flags.append(f"--sync-each-microbatch ({_gib(c.memory.held)} GiB are fp32 gradients held unsharded until the "
                     "step's last backward; LongContextTrainer(sync_each_microbatch=True) shards them)")
    if c.microbatches > 1:
        flags.append(f"fewer micro-batches per step (now {c.microbatches}: --microbatches / --tokens-per-step)")
    flags.append("a shorter --seq-len / --micro-batch-tokens")
    return (f"GPU memory binds: {_gib(c.memory.peak)} GiB per GPU needed, {_gib(args.gpu_memory * usable)} GiB usable "
            f"of --gpu-memory {_gib(args.gpu_memory)} GiB; change " + ", ".join(flags))


def _fit_line(args: argparse.Namespace, c) -> str:
    """How close the suggestion is to each limit (which one binds first)."""
    usable = 1 - args.headroom
    gpu = c.memory.peak / (args.gpu_memory * usable)
    host = c.memory.host * min(args.gpus, args.gpus_per_node) / (args.host_memory * usable)
    which = "GPU memory (--gpu-memory)" if gpu >= host else "host memory (--host-memory)"
    return (f"uses {gpu:.0%} of the usable GPU memory and {host:.0%} of the usable host memory: {which} binds first")


def _plot(args: argparse.Namespace, config: Any, best) -> str:
    from hf_longctx.data.cost import CostModel
    from hf_longctx.data.layout import doc_multiple, seq_multiple
    from hf_longctx.data.packing import plan_microbatches
    from hf_longctx.planning import plot

    s = best.setting
    cap = args.micro_batch_tokens
    if args.lengths_file:
        pool, source = plot.read_lengths(args.lengths_file), f"lengths from {args.lengths_file}"
    else:
        pool, source = plot.synthetic_lengths(cap, seed=args.seed), f"synthetic log-normal lengths (seed {args.seed})"
    lengths = plot.sample_step(pool, best.dp * cap * args.plot_microbatches, cap, seed=args.seed)
    cost = CostModel.from_config(config.get_text_config() if hasattr(config, "get_text_config") else config)
    dm = doc_multiple(s.ring)  # FPDT runs with ring 1, where this is 1
    plan = plan_microbatches(lengths, dp_size=best.dp, max_tokens=cap, cost=cost, doc_multiple=dm,
                             seq_multiple=seq_multiple(s.ring, s.ulysses, s.fpdt_chunks), overlong="split")
    title = (f"per-rank load of one sampled step: ulysses {s.ulysses} x ring {s.ring}, dp {best.dp}, "
             f"{cap} tokens per micro-batch\n{source}")
    stats = plot.draw_load(plan, cost, args.plot, title)
    return (f"wrote {args.plot}: one step of {len(lengths)} documents ({source}) planned for dp {best.dp}, "
            f"{plan.num_microbatches} micro-batches per rank; synchronised step / ideal = {stats['synced_over_ideal']:.3f}")


def _plot_flex(args: argparse.Namespace, config: Any, best) -> str:
    """The flexible plan of one sampled step at the best setting's tokens per rank, drawn
    per rank with each slot's group sizes; compared with that setting's fixed degree."""
    from hf_longctx.data.cost import GroupCost
    from hf_longctx.data.flex.groups import group_shapes
    from hf_longctx.data.flex.packing import plan_fixed, plan_flexible
    from hf_longctx.data.flex.unequal import plan_unequal
    from hf_longctx.data.model_dims import ModelDims
    from hf_longctx.distributed.flex.collator import layout_text
    from hf_longctx.planning import plot

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    s, world = best.setting, args.gpus
    per_rank = args.micro_batch_tokens // s.sp  # the best fixed setting's tokens per rank
    shapes = group_shapes(world, heads=ModelDims.from_config(text).heads, max_size=world & -world,
                          ranks_per_node=min(args.gpus_per_node, world & -world))
    fixed_shape = next((sh for sh in shapes if sh.size == s.sp), None)
    cost = GroupCost.from_config(text, shapes, flops_per_s=args.tflops * 1e12 * args.mfu, ulysses_bw=args.intra_bw,
                                 ring_bw=args.inter_bw)
    max_len = (fixed_shape or shapes[-1]).capacity(per_rank)  # documents the fixed setting can hold too
    if args.lengths_file:
        pool, source = plot.read_lengths(args.lengths_file), f"lengths from {args.lengths_file}"
    else:
        pool, source = plot.synthetic_lengths(max_len, seed=args.seed), f"synthetic log-normal lengths (seed {args.seed})"
    lengths = plot.sample_step(pool, world * per_rank * args.plot_microbatches, max_len, seed=args.seed)
    if args.unequal_calls:
        flex = plan_unequal(lengths, shapes=shapes, world_size=world, max_tokens_per_rank=per_rank, cost=cost)
        mode = "unequal micro-batch counts (makespan)"
    else:
        flex = plan_flexible(lengths, shapes=shapes, world_size=world, max_tokens_per_rank=per_rank, cost=cost,
                             num_slots=args.plot_microbatches)
        mode = "equal micro-batch counts (synchronised slots)"
    title = (f"flexible SP groups, one sampled step: {world} ranks, {per_rank} tokens per rank per micro-batch\n"
             f"{mode}; {source}")
    stats = plot.draw_flex_load(flex, cost, args.plot, title)
    out = (f"wrote {args.plot}: one step of {len(lengths)} documents ({source}) planned with flexible SP groups and "
           f"{mode} on {world} ranks, {per_rank} tokens per rank; slot layouts {layout_text(flex.layouts())}; "
           f"micro-batches per rank {stats['calls'][0]}-{stats['calls'][1]}; modelled step / "
           f"ideal = {stats['synced_over_ideal']:.3f}; per-rank busy max/mean = {stats['busy_max_over_mean']:.3f}")
    if fixed_shape is not None:
        fixed = plan_fixed(lengths, shape=fixed_shape, shapes=shapes, world_size=world, max_tokens_per_rank=per_rank,
                           cost=cost).stats(cost)
        out += (f"\nthe suggestion's fixed degree on the same step (sp {s.sp}, dp {world // s.sp}; split as the "
                f"bank's group of {s.sp}: ulysses {fixed_shape.ulysses} x ring {fixed_shape.ring}): synchronised step / ideal = {fixed['synced_over_ideal']:.3f}; "
                f"modelled speed-up of flexible groups {fixed['synced_step'] / stats['synced_step']:.2f}x")
    return out


def cmd_plan(args: argparse.Namespace) -> int:
    from hf_longctx.planning.memory import ModelDims
    from hf_longctx.planning.search import TIE_TOLERANCE, Cluster, Suggestion, rank_settings

    if args.unequal_calls and args.sync_each_microbatch:
        print("--unequal-calls syncs gradients in each rank's own last backward; it cannot be combined with "
              "--sync-each-microbatch", file=sys.stderr)
        return 2
    args.micro_batch_tokens = args.micro_batch_tokens or args.seq_len
    if args.tokens_per_step is not None and args.microbatches is not None:
        print("give --microbatches or --tokens-per-step, not both (the second derives the first per setting)",
              file=sys.stderr)
        return 2
    if args.tokens_per_step is None:
        args.microbatches = args.microbatches or 1
    config = load_config(args.model)
    dims = ModelDims.from_config(config)
    cluster = Cluster(
        gpus=args.gpus, gpu_memory=args.gpu_memory, host_memory=args.host_memory, gpus_per_node=args.gpus_per_node,
        tflops=args.tflops, mfu=args.mfu, intra_bw=args.intra_bw, inter_bw=args.inter_bw, pcie_bw=args.pcie_bw,
        headroom=args.headroom, latency=args.latency, cpu_optim_bw=args.cpu_optim_bw,
    )
    grad_sync = "microbatch" if args.sync_each_microbatch else "step"
    ranked = rank_settings(config, cluster, args.micro_batch_tokens, seq_len=args.seq_len, dtype=args.dtype,
                           optimizer=args.optimizer, unsharded_step=args.unequal_calls, grad_sync=grad_sync,
                           microbatches=args.microbatches or 1, tokens_per_step=args.tokens_per_step,
                           param_offload=args.param_offload)
    feasible = [c for c in ranked if c.feasible]
    print(f"hf-longctx plan: {getattr(config, 'model_type', '?')} ({dims.params / 1e9:.2f}B params, {dims.layers} layers, "
          f"hidden {dims.hidden}, {dims.heads}/{dims.kv_heads} heads, vocab {dims.vocab}) on {args.gpus} GPUs x "
          f"{_gib(args.gpu_memory)} GiB, host {_gib(args.host_memory)} GiB per node, seq-len {args.seq_len}, "
          f"{args.dtype}, {args.optimizer}, "
          + (f"{args.microbatches} micro-batch(es) per rank and step" if args.tokens_per_step is None
             else f"{args.tokens_per_step} tokens per step") + "\n")
    if not feasible:
        if args.show_infeasible:
            print(format_table([_row("-", c) for c in ranked]))
            print(footer(args))
        # The setting closest to fitting: lowest GPU peak among those whose host memory fits, else lowest host need.
        host_ok = [c for c in ranked if c.binding != "host memory"]
        low = min(host_ok, key=lambda c: c.memory.peak) if host_ok else min(ranked, key=lambda c: c.memory.host)
        s = low.setting
        print(f"no setting fits: the closest is ulysses {s.ulysses}, ring {s.ring}, fpdt {s.fpdt_chunks}, memory "
              f"{low.preset!r}, param offload {s.param_offload} ({low.reason}).\n{_binding_advice(args, low)}"
              + ("" if args.show_infeasible else "\n(--show-infeasible lists every setting with why it does not fit)"),
              file=sys.stderr)
        return 1
    shown = feasible[: args.top]
    rows = [_row(i + 1, c) for i, c in enumerate(shown)]
    if args.show_infeasible:
        rows += [_row("-", c) for c in ranked if not c.feasible]
    print(format_table(rows))
    print(f"\n{len(feasible)} of {len(ranked)} settings fit; showing the best {len(shown)}"
          + ("" if args.show_infeasible else f"; {len(ranked) - len(feasible)} infeasible not shown (--show-infeasible)"))
    print(footer(args))
    # what hf_longctx.planning.search.suggest() returns
    best = Suggestion.of(feasible[0], args.micro_batch_tokens, grad_sync=grad_sync, dtype=args.dtype)
    tied = [c for c in feasible if c.tied]
    if tied:
        print(f"\nrows 1-{len(tied)} are within {TIE_TOLERANCE:.0%} of the fastest estimate, less than the cost model's "
              "measured error: the estimates do not separate them; "
              + ("the first follows the USP guidance (Ulysses inside a node, ring only across nodes)"
                 if cluster.follows_usp_guidance(feasible[0].setting) else "none of them follows the USP guidance"))
    print(f"\nsuggested (fastest estimate that fits; {_fit_line(args, feasible[0])}):\n{best.code()}")
    print(f"\nas recipe flags (recipes/pretrain.py, lora.py, sft.py):\n{best.recipe_flags()}")
    if args.plot:
        print((_plot_flex if args.flex else _plot)(args, config, feasible[0]))
    return 0


def cmd_step_plot(args: argparse.Namespace) -> int:
    from hf_longctx.planning import plot

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
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--tflops", type=float, default=989.0, help="peak dense TFLOP/s per GPU (default: H100 SXM bf16)")
    p.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation")
    p.add_argument("--intra-bw", type=parse_size, default=150e9, help="per-GPU bandwidth within a node, bytes/s")
    p.add_argument("--inter-bw", type=parse_size, default=25e9, help="per-GPU bandwidth across nodes, bytes/s")
    p.add_argument("--pcie-bw", type=parse_size, default=25e9, help="per-GPU host<->device bandwidth, bytes/s")
    p.add_argument("--latency", type=float, default=30e-6, help="seconds per all-to-all call")
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
