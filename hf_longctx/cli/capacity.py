"""`hf-longctx plan`: rank every setting for a model on a cluster, print the table, the
binding limit and the suggestion as code and as recipe flags.

Where it sits: behind the `plan` subcommand of `hf_longctx/cli/__init__.py`; the ranking is
`capacity/search.py` (memory model `capacity/estimate.py`), the flags read together
`cli/plan_flags.py`, what binds `cli/binding.py`, the optional figure `cli/plots.py`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from hf_longctx.cli.binding import binding_advice, closest, fit_line
from hf_longctx.cli.inputs import gib, load_config
from hf_longctx.cli.plan_flags import plan_trainer, resolve_flags, sync_source, syncs_each_microbatch
from hf_longctx.cli.plots import plot_flexible_step, plot_step


def _chunked(s) -> str:
    """The "chunked mlp/loss" cell: the LM head's rows where the plan lowered them (`capacity/fits.py`)."""
    return "no" if s.mlp_chunks <= 1 else f"yes (loss rows {s.loss_chunk_rows})" if s.loss_chunk_rows else "yes"


def _row(rank: int | str, c) -> list[str]:
    s, m = c.setting, c.memory
    return [str(rank), str(s.ulysses), str(s.ring), str(c.dp), str(s.fpdt_chunks), c.preset, "yes" if s.kv_offload else "no",
            ("full, keep attn out" if s.keep_attention else "full") if s.checkpoint is True else {"attention": "keep attn"}.get(s.checkpoint, "no"), _chunked(s), str(s.inputs_on_device), "yes" if s.param_offload else "no",
            str(c.microbatches), gib(m.params), gib(m.grads + m.held), gib(m.optimizer), gib(m.activations), gib(m.buffers + m.backward_grads), gib(m.peak),
            gib(m.host), *((f"{c.step_seconds:.2f}", f"{c.tokens_per_second / c.dp / c.setting.sp:,.0f}")
                           if c.time is not None else ("-", "-")),
            f"{100 * c.time.mfu:.1f}" if c.time is not None else "-", c.time.binds if c.time is not None else "-",
            "yes" if c.feasible else f"no: {c.reason}"]


HEADER = ["#", "ulysses", "ring", "dp", "fpdt", "memory", "kv offload", "ckpt", "chunked mlp/loss", "inputs on GPU",
          "param offload",
          "micro-batches", "params", "grads",
          "optim", "activ", "buffers", "peak GiB", "host GiB/GPU", "step s", "tok/s/GPU", "MFU %", "binds", "fits"]


def format_table(rows: list[list[str]]) -> str:
    """A Markdown table (readable in a terminal and pasteable into an issue)."""
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]

    def line(r: list[str]) -> str:  # numbers right-aligned, the free-text "fits" column left-aligned
        return "| " + " | ".join(v.rjust(w) if i < len(HEADER) - 1 else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))) + " |"

    return "\n".join([line(HEADER), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def footer(args: argparse.Namespace) -> str:
    from hf_longctx.capacity.search import TIE_TOLERANCE
    gpu = _cluster(args).gpu_spec
    return "\n".join([
        "Assumptions (hf_longctx/capacity/estimate.py and search.py docstrings):",
        f"- memory per GPU in GiB; ZeRO-3 over all {args.gpus} GPUs: fp32 params, fp32 grads, {args.optimizer} "
        "states (AdamW: 2 fp32 moments) sharded; plus FSDP's gathered units (2 layers, or LM head + 1 layer) and "
        "one unit's unsharded grads in the compute dtype; "
        + (f"gradients reduce-scattered in every micro-batch's backward ({sync_source(args)}), the earlier "
           "micro-batches' sharded fp32 gradients held through the step;" if syncs_each_microbatch(args)
           else "with several micro-batches per step the trainer reduce-scatters in the last backward only, so the fp32 "
           "unsharded gradients (4 B/param) are held through the step (in grads; --sync-each-microbatch shards them);"),
        "- activ = what autograd keeps for a Llama-style layer at S/sp tokens per GPU (checkpointing: layer inputs, "
        "on host; FPDT+offload: q/k/v/out on host); buffers = the larger transient of the loss and of one layer's "
        "backward (all-to-all, ring, recompute) and the gradients made before that layer's backward; "
        "peak = params + optim + max(grads, activ + buffers);",
        "- inputs on GPU = N: where host memory binds and the GPU has room, the fewest last decoder layers whose "
        "checkpointed inputs stay on the GPU (in activ, not in host) that make the host fit "
        "(patch(..., inputs_on_device=N)); ckpt 'full, keep attn out' = memory='max' with keep_attention=True: each "
        "layer's attention output and LSE kept on the host (in host), no attention recompute in the backward;",
        *([f"- --unequal-calls: every rank holds the whole model in {args.dtype} for the step (in params) next to the "
           "held fp32 unsharded gradients, as ranks run different numbers of micro-batches "
           "(flex/unsharded_step.py);"]
          if args.unequal_calls else []),
        "- held fp32 gradients sit next to every micro-batch's activations: peak = params + optim + held + "
        "max(grads - held, activ + buffers);",
        f"- fits = peak <= (1 - {args.headroom}) x --gpu-memory and host GiB/GPU x GPUs per node <= (1 - "
        f"{args.headroom}) x --host-memory; validated within 10% on CPU (benchmarks/memory_model.py);",
        _time_line(args, gpu),
        "- param offload (FSDP2 CPUOffloadPolicy; --param-offload auto|yes|no): the fp32 parameter and gradient "
        "shards and the optimizer states on host (in host GiB/GPU), their PCIe traffic overlapped, the optimizer step "
        f"on the CPU at {args.cpu_optim_bw / 1e9:g} GB/s per GPU (--cpu-optim-bw), not overlapped;",
        "- micro-batches = per rank and step (--microbatches, or --tokens-per-step / (dp x micro-batch tokens)); with "
        "one, no earlier gradients are held;",
        *([f"- --task {args.task}: " + ("no reference held or run (its log-probs precomputed once, before "
                                          "training)" if args.task == "dpo-precomputed" else
                                          "the frozen reference's fp32 ZeRO-3 shards (in params) and its forward (a "
                                          "phase before the policy's)")
           + ", the chunked log-prob head's forward and backward in place of the loss, the objective's per-token "
           "inputs; a pair's or a group's documents count together in --seq-len"
           + (f"; rollouts on these GPUs, where {plan_trainer(args).name} always generates them: --rollout-tokens "
              f"{args.rollout_tokens} tokens " + ("per SP group" if args.generation == "sp" else "per GPU")
              + (" (not given: --seq-len)" if args.rollout_tokens_assumed else "")
              + (" (sequence-parallel: 1/SP of their KV cache per GPU, the prefill sharded as a training step, the "
                 "weights gathered once where that fits, else FSDP2's per-unit gathers)" if args.generation == "sp" else
                 " (per rank: the whole model gathered, KV cache, one layer's prefill)")
              + " as a phase of their own (peak = params + optim + max(grads, activ + buffers, rollouts))"
              if args.task in ("grpo", "rloo") else "") + ";"]
          if args.task != "sft" else []),
        *([f"- --task {args.task}: {plan_trainer(args).name} takes no param_offload, so only settings without "
           "parameter offload are searched;"] if not plan_trainer(args).trainer_options else []),
        *(["- best first = fits, then highest cluster tokens/s (dp x tokens / step s), then lowest peak; estimates "
           f"within {TIE_TOLERANCE:.0%} of the fastest (the cost model's measured error) are not told apart: among them "
           "the USP guidance (Ulysses inside a node, ring only across nodes) ranks first."] if gpu.timed else []),
    ])


def _time_line(args: argparse.Namespace, gpu: Any) -> str:
    """The footer's bullet on the step-time columns: how the model times a step on `gpu`, or
    why it does not (a card without measured kernel fractions) and how the rows are ordered."""
    if not gpu.timed:
        return (f"- step s, tok/s/GPU, MFU %, binds: none: {gpu.untimed()}; the settings that fit are listed in an "
                "order that is not a time: a lighter memory preset, no parameter offload, fewer FPDT chunks, "
                "keep_attention, the USP guidance, then the lowest peak (capacity/search.untimed_order);")
    return (f"- step s = one micro-batch of {args.micro_batch_tokens} tokens per SP group (documents of "
            f"{args.seq_len}) on one {gpu.name} (--gpu; hf_longctx/capacity/gpus.py), by the step-time model: the op "
            "inventory of the patched step (every kernel, collective and copy; capacity/inventory.py), each op "
            f"max(FLOPs / achieved rate, HBM bytes / {gpu.hbm:.0%} of {gpu.hbm_bw / 1e12:g} TB/s) + "
            f"{gpu.launch_s * 1e6:g} us per kernel; GEMMs at {gpu.gemm:.0%} and attention ({gpu.modelled_attention(128)}) "
            f"at {gpu.attention_fraction(128, False):.0%} / {gpu.attention_fraction(128, True):.0%} (fwd / bwd) of "
            f"{gpu.bf16_flops / 1e12:g} TFLOP/s; Ulysses all-to-alls block ({gpu.nvlink_bw / 1e9:g} GB/s in a node of "
            f"{args.gpus_per_node}, {gpu.ib_bw / 1e9:g} GB/s across, x{gpu.nccl:g} achieved, "
            f"{gpu.collective_s * 1e6:g} us per call); ring P2P, FSDP and host offload ({gpu.pcie_h2d / 1e9:g} / "
            f"{gpu.pcie_d2h / 1e9:g} GB/s to / from the GPU) count beyond the compute they overlap; MFU % = this "
            "project's strict count, 6 N T + the causal half of each document's attention square, recompute not "
            "counted, / (step s x peak): below torchtitan's count (the whole square) and Megatron-DeepSpeed's (the "
            "whole square, and the recompute under checkpointing), both printed for the suggestion (capacity/mfu.py); "
            "binds = the largest term (the attention kernels' or the GEMMs' compute-bound time, HBM-bound kernels, "
            "launches, a link, PCIe, the CPU optimizer);")


def cmd_plan(args: argparse.Namespace) -> int:
    """`hf-longctx plan`: rank every setting and print the table, the assumptions and the
    suggestion (exit 0), or the closest setting and what binds it when nothing fits (exit 1);
    contradictory flags and a visual budget longer than --seq-len are refused (exit 2)."""
    from hf_longctx.capacity.estimate import ModelDims
    from hf_longctx.capacity.search import rank_settings

    refusal = resolve_flags(args)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    config = load_config(args.model)
    dims = ModelDims.from_config(config)
    vision, refusal = _vision(args, config)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    cluster = _cluster(args)
    grad_sync = "microbatch" if syncs_each_microbatch(args) else "step"
    rank = lambda task: rank_settings(  # noqa: E731 (a DPO plan ranks twice: capacity/dpo_reference.py)
        config, cluster, args.micro_batch_tokens, seq_len=args.seq_len, dtype=args.dtype, optimizer=args.optimizer,
        unsharded_step=args.unequal_calls, grad_sync=grad_sync, microbatches=args.microbatches or 1,
        tokens_per_step=args.tokens_per_step, param_offload=args.param_offload, vision=vision, task=task,
        rollout_tokens=args.rollout_tokens, generation=args.generation)
    ranked = rank(args.task)
    feasible = [c for c in ranked if c.feasible]
    print(_heading(args, config, dims, vision) + "\n")
    if args.task == "dpo":
        return _plan_dpo(args, config, cluster, dims, ranked, rank("dpo-precomputed"), grad_sync)
    if not feasible:
        return _print_closest(args, ranked, dims)
    _print_table(args, ranked, feasible)
    _print_ties(cluster, dims, feasible)
    why = "fastest estimate that fits" if cluster.gpu_spec.timed else "the first that fits, in the order above: no step time"
    _print_suggestion(args, config, feasible, grad_sync, args.task, why)
    return 0


def _plan_dpo(args: argparse.Namespace, config: Any, cluster: Any, dims: Any, held: list, precomputed: list,
              grad_sync: str) -> int:
    """`--task dpo`: the held reference's table (or its closest setting), which reference is picked
    and why (capacity/dpo_reference.py), then the suggestion of the one picked, so that the code
    and flags printed last are the setting the verdict names."""
    from hf_longctx.capacity.dpo_reference import pick_reference

    verdict, picked = pick_reference(held, precomputed)
    feasible = [c for c in held if c.feasible]
    if feasible:
        _print_table(args, held, feasible)
        _print_ties(cluster, dims, feasible)
    else:
        _print_closest(args, held, dims, " with the reference held" if picked else "")
    print("\n" + verdict)
    if picked is None:
        return 1
    _print_suggestion(args, config, [c for c in precomputed if c.feasible], grad_sync, picked,
                      "the precomputed reference, as picked above: its fastest estimate that fits, the first row of "
                      "--task dpo-precomputed")
    return 0


def _attention_line(args: argparse.Namespace, head_dim: int) -> str:
    """Which attention kernel the step-time model runs, and why: named, or the fastest measured."""
    gpu = _cluster(args).gpu_spec
    name = gpu.modelled_attention(head_dim)
    if args.attention_backend is not None:
        return f"attention kernel {name} (--attention-backend)"
    measured = [n for n, _ in gpu.measured_attention]
    if not measured:
        return f"no attention kernel measured on {gpu.name}: not timed (capacity/gpus.py)"
    return f"attention kernel {name} (the fastest measured on {gpu.name} of {', '.join(measured)}; capacity/gpus.py)"


def _cluster(args: argparse.Namespace):
    from hf_longctx.capacity.cluster import Cluster

    return Cluster(
        gpus=args.gpus, gpu_memory=args.gpu_memory, host_memory=args.host_memory, gpus_per_node=args.gpus_per_node,
        gpu=args.gpu, intra_bw=args.intra_bw, inter_bw=args.inter_bw, pcie_bw=args.pcie_bw, headroom=args.headroom,
        latency=args.latency, cpu_optim_bw=args.cpu_optim_bw, attention_backend=args.attention_backend,
    )


def _vision(args: argparse.Namespace, config: Any) -> tuple[Any, str | None]:
    """(the vision tower's budget from the image / video flags or None, why it is refused or None)."""
    from hf_longctx.capacity.vision import vision_budget

    try:
        vision = vision_budget(config, images=args.images, image_tokens=args.image_tokens, video_seconds=args.video_seconds,
                               fps=args.fps, frame_tokens=args.frame_tokens)
    except ValueError as e:
        return None, str(e)
    if vision is not None and vision.tokens > args.seq_len:
        return vision, (f"a sample's visual content is {vision.tokens} tokens, more than --seq-len {args.seq_len} "
                        "(which counts them): raise --seq-len or lower the image / video budget")
    return vision, None


def _heading(args: argparse.Namespace, config: Any, dims: Any, vision: Any) -> str:
    """The first line: the model's sizes, the cluster, the step, and the vision budget charged."""
    return (f"hf-longctx plan: {getattr(config, 'model_type', '?')} ({dims.params / 1e9:.2f}B params, {dims.layers} layers, "
            f"hidden {dims.hidden}, {dims.heads}/{dims.kv_heads} heads, vocab {dims.vocab}) on {args.gpus} GPUs x "
            f"{gib(args.gpu_memory)} GiB, host {gib(args.host_memory)} GiB per node, seq-len {args.seq_len}, "
            f"{args.dtype}, {args.optimizer}, "
            + (f"{args.microbatches} micro-batch(es) per rank and step" if args.tokens_per_step is None
               else f"{args.tokens_per_step} tokens per step")
            + (f"; vision tower {vision.dims.params / 1e6:.0f}M params, {vision.tokens} visual tokens per sample "
               f"({args.images} images x {args.image_tokens}, {vision.slices} video slices x {args.frame_tokens}) charged "
               "(capacity/vision.py)" if vision is not None else "")
            + f"; {_attention_line(args, dims.head_dim)}")


def _print_closest(args: argparse.Namespace, ranked: list, dims: Any, which: str = "") -> int:
    """Nothing fits: every setting with --show-infeasible, then the setting closest to fitting and
    what binds it (stderr); exit status 1. `which`: the settings meant (" with the reference held")."""
    if args.show_infeasible:
        print(format_table([_row("-", c) for c in ranked]))
        print(footer(args))
    low = closest(args, ranked)
    s = low.setting
    print(f"no setting fits{which}: the closest is ulysses {s.ulysses}, ring {s.ring}, fpdt {s.fpdt_chunks}, memory "
          f"{low.preset!r}, param offload {s.param_offload} ({low.reason}).\n{binding_advice(args, low, dims)}"
          + ("" if args.show_infeasible else "\n(--show-infeasible lists every setting with why it does not fit)"),
          file=sys.stderr)
    return 1


def _print_table(args: argparse.Namespace, ranked: list, feasible: list) -> None:
    """The best --top settings that fit (with --show-infeasible every other), the count, the assumptions."""
    shown = feasible[: args.top]
    rows = [_row(i + 1, c) for i, c in enumerate(shown)]
    if args.show_infeasible:
        rows += [_row("-", c) for c in ranked if not c.feasible]
    print(format_table(rows))
    print(f"\n{len(feasible)} of {len(ranked)} settings fit; showing the best {len(shown)}"
          + ("" if args.show_infeasible else f"; {len(ranked) - len(feasible)} infeasible not shown (--show-infeasible)"))
    print(footer(args))


def _print_ties(cluster: Any, dims: Any, feasible: list) -> None:
    """Whether the estimates tell the table's first rows apart, and whether the first follows the USP guidance."""
    from hf_longctx.capacity.search import TIE_TOLERANCE

    tied = [c for c in feasible if c.tied]
    if tied:
        print(f"\nrows 1-{len(tied)} are within {TIE_TOLERANCE:.0%} of the fastest estimate, less than the cost model's "
              "measured error: the estimates do not separate them; "
              + ("the first follows the USP guidance (Ulysses inside a node, ring only across nodes)"
                 if cluster.follows_usp_guidance(feasible[0].setting, dims.heads, dims.kv_heads)
                 else "none of them follows the USP guidance"))


def _mfu_line(args: argparse.Namespace, config: Any, c) -> str:
    """The suggestion's modelled MFU by this project's count and by torchtitan's and
    Megatron-DeepSpeed's, for comparison with figures published under theirs."""
    from hf_longctx.capacity.estimate import ModelDims
    from hf_longctx.capacity.mfu import mfu_line

    t = c.time
    line = mfu_line(ModelDims.from_config(config), args.micro_batch_tokens, t.seconds * c.setting.sp,
                    t.gpu.bf16_flops, seq_len=args.seq_len, checkpointed=bool(c.setting.checkpoint))
    return line + " (capacity/mfu.py: each count and its source)"


def _print_suggestion(args: argparse.Namespace, config: Any, feasible: list, grad_sync: str, task: str,
                      why: str) -> None:
    """The first feasible setting of `task`'s ranking (what `capacity/search.suggest()` returns) as
    code and as recipe flags, `why` it is the one, and the --plot figure."""
    from hf_longctx.capacity.search import Suggestion

    best = Suggestion.of(feasible[0], args.micro_batch_tokens, grad_sync=grad_sync, dtype=args.dtype, task=task)
    print(f"\nsuggested ({why}; {fit_line(args, feasible[0])}):\n{best.code()}")
    if feasible[0].time is not None:
        print(f"\nmodelled {_mfu_line(args, config, feasible[0])}")
    print(f"\nas recipe flags ({best.recipes}):\n{best.recipe_flags()}")
    if args.plot:
        print((plot_flexible_step if args.flex else plot_step)(args, config, feasible[0]))
