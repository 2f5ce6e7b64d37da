"""Which limit binds a plan, in words that name the flags that change it: the closest setting
when nothing fits (GPU memory, host memory, or the rollouts that GRPO and RLOO generate on the
training GPUs: `--rollout-tokens`) and how close the suggestion comes to each limit.

Where it sits: the last lines of `hf-longctx plan` (`cli/capacity.py`), read from a
`capacity/search.Candidate` and the plan's flags; it estimates nothing itself.
"""

from __future__ import annotations

import argparse

from hf_longctx.cli.inputs import gib
from hf_longctx.cli.plan_flags import plan_trainer, syncs_each_microbatch


def rollouts_set_peak(c) -> bool:
    """Whether generating the rollouts, not the training step, sets the GPU peak of `c`."""
    return c.memory.generation > 0 and c.memory.peak > c.memory.training_peak


def closest(args: argparse.Namespace, ranked: list):
    """The setting closest to fitting when none does: among the settings that fit the GPU, the
    least host memory (host binds); else those whose training step alone fits the GPU (only their
    rollouts bind it, and fewer rollout tokens lift that), fitting the host first, then the lowest
    GPU peak; else among those that fit the host, the lowest GPU peak (GPU binds); else the lowest
    GPU peak (both bind)."""
    gpu_ok = [c for c in ranked if c.gpu_fits and c.binding]
    if gpu_ok:
        return min(gpu_ok, key=lambda c: c.memory.host)
    usable = args.gpu_memory * (1 - args.headroom)
    training_fits = [c for c in ranked if c.binding and c.memory.training_peak <= usable]
    if training_fits:
        return min(training_fits, key=lambda c: (not c.host_fits, c.memory.peak, c.memory.host))
    host_ok = [c for c in ranked if c.host_fits and c.binding]
    return min(host_ok or [c for c in ranked if c.binding] or ranked, key=lambda c: c.memory.peak)


def binding_advice(args: argparse.Namespace, c, dims) -> str:
    """Which resource rules out `c` (the setting closest to fitting) and the flags that change it;
    `dims`: the model's sizes (the rollout tokens that would fit)."""
    usable = 1 - args.headroom
    if c.binding in ("host memory", "GPU and host memory"):
        less = "--param-offload no, a lighter memory preset" if plan_trainer(args).trainer_options else (
            f"a lighter memory preset; {plan_trainer(args).name} offloads no parameters")
        host = (f"HOST memory binds: {gib(c.memory.host * min(args.gpus, args.gpus_per_node))} GiB per node needed, "
                f"{gib(args.host_memory * usable)} GiB usable of --host-memory {gib(args.host_memory)} GiB; raise "
                f"--host-memory, or offload less ({less}) with more GPU memory")
        if c.binding == "host memory":
            return host + " (this setting fits the GPU)"
        return host + "; and " + (rollout_advice(args, c, dims) if rollouts_set_peak(c) else gpu_advice(args, c))
    return rollout_advice(args, c, dims) if rollouts_set_peak(c) else gpu_advice(args, c)


def gpu_advice(args: argparse.Namespace, c) -> str:
    """GPU memory binds the training step of `c`: its peak, the usable memory, the flags that lower it."""
    usable = 1 - args.headroom
    return (f"GPU memory binds: {gib(c.memory.peak)} GiB per GPU needed, {gib(args.gpu_memory * usable)} GiB usable "
            f"of --gpu-memory {gib(args.gpu_memory)} GiB; change " + ", ".join(_training_flags(args, c)))


def _training_flags(args: argparse.Namespace, c) -> list[str]:
    """The flags that lower the training step's GPU peak of `c`."""
    flags = ["--gpu-memory", "more --gpus"]
    if args.param_offload == "no" and plan_trainer(args).trainer_options:
        flags.append("--param-offload auto (parameters, gradients and optimizer states on host)")
    if c.memory.held and not syncs_each_microbatch(args) and not args.unequal_calls:
        flags.append(f"--sync-each-microbatch ({gib(c.memory.held)} GiB are fp32 gradients held unsharded until the "
                     f"step's last backward; {plan_trainer(args).name}(sync_each_microbatch=True) shards them)")
    if c.microbatches > 1:
        flags.append(f"fewer micro-batches per step (now {c.microbatches}: --microbatches / --tokens-per-step)")
    flags.append("a shorter --seq-len / --micro-batch-tokens")
    return flags


def rollout_advice(args: argparse.Namespace, c, dims) -> str:
    """GPU memory binds `c` in its rollouts' phase: what `--rollout-tokens` counts and what it was
    taken to be, the training step's own peak, and the most rollout tokens that fit instead."""
    from hf_longctx.capacity.budget_terms import DTYPE_BYTES
    from hf_longctx.capacity.generation_budget import sp_rollout_tokens_within
    from hf_longctx.capacity.task_budget import rollout_tokens_within

    usable, m, tokens = args.gpu_memory * (1 - args.headroom), c.memory, args.rollout_tokens
    alone, sp = m.training_peak, args.generation == "sp"
    assumed = f" (not given: --seq-len, {args.seq_len}, assumed)" if args.rollout_tokens_assumed else ""
    unit = "per SP group" if sp else "per GPU"
    text = (f"GPU memory binds, and the rollouts set it: generating {tokens} tokens {unit} needs {gib(m.peak)} GiB "
            f"per GPU (the training step alone {gib(alone)} GiB), {gib(usable)} GiB usable of --gpu-memory "
            f"{gib(args.gpu_memory)} GiB. --rollout-tokens{assumed} counts the prompt + completion tokens one "
            "generation decodes per step")
    if sp:
        text += (f" (the SP group's rows: per_device_train_batch_size x SP degree x (prompt + max_completion_length)); "
                 f"{plan_trainer(args).name} generates them sequence-parallel, each GPU holding 1/SP of their KV cache: "
                 "a larger SP degree (more --gpus) shrinks each GPU's share")
    else:
        text += (" (per_device_train_batch_size x (prompt + max_completion_length)); with --generation per-rank "
                 f"{plan_trainer(args).name} generates them on the training GPUs with the whole model gathered and "
                 "every layer's KV cache, without sequence parallelism: more GPUs or a lighter memory preset do not "
                 "shrink them (--generation sp does)")
    if alone > usable:
        return (text + "; and the training step alone does not fit either: change "
                + ", ".join(_training_flags(args, c)))
    if sp:
        fit = sp_rollout_tokens_within(dims, c.setting, args.dtype, m, tokens, usable)
    else:
        fit = rollout_tokens_within(dims, DTYPE_BYTES[args.dtype], m, tokens, usable)
    if not fit:
        return text + ". Not even the rollout's weights fit beside the training shards: change --gpu-memory"
    return (text + f". At most {fit:,} rollout tokens {unit} fit at this setting: give --rollout-tokens {fit} or "
            "fewer (fewer rows per device, shorter prompts or completions), or change --gpu-memory")


def fit_line(args: argparse.Namespace, c) -> str:
    """How close the suggestion is to each limit (which one binds first, and whether the
    rollouts set the GPU peak)."""
    usable = 1 - args.headroom
    gpu = c.memory.peak / (args.gpu_memory * usable)
    host = c.memory.host * min(args.gpus, args.gpus_per_node) / (args.host_memory * usable)
    which = "GPU memory (--gpu-memory)" if gpu >= host else "host memory (--host-memory)"
    if gpu >= host and rollouts_set_peak(c):
        unit = "per SP group" if args.generation == "sp" else "per GPU"
        which = (f"GPU memory binds first, set by the rollouts (--rollout-tokens {args.rollout_tokens} {unit}; the "
                 f"training step alone uses {c.memory.training_peak / (args.gpu_memory * usable):.0%})")
        return f"uses {gpu:.0%} of the usable GPU memory and {host:.0%} of the usable host memory: {which}"
    return (f"uses {gpu:.0%} of the usable GPU memory and {host:.0%} of the usable host memory: {which} binds first")
