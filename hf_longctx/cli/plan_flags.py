"""`hf-longctx plan`'s flags read together: the contradictions refused, the derived defaults
filled in, and the trainer of `--task` (`capacity/suggestion.TASK_TRAINERS`) whose options the
other flags must fit.

Where it sits: the first step of `cmd_plan` (`cli/capacity.py`), after argparse's own checks
(`cli/__init__.py`) and before any estimate; a refusal is a message that names the flags.
"""

from __future__ import annotations

import argparse


def plan_trainer(args: argparse.Namespace):
    from hf_longctx.capacity.suggestion import task_trainer

    return task_trainer(args.task)


def syncs_each_microbatch(args: argparse.Namespace) -> bool:
    return args.sync_each_microbatch or plan_trainer(args).always_syncs_each_microbatch


def sync_source(args: argparse.Namespace) -> str:
    t = plan_trainer(args)
    return f"{t.name} always does" if t.always_syncs_each_microbatch else "--sync-each-microbatch"


def resolve_flags(args: argparse.Namespace) -> str | None:
    """Why the flags contradict each other, or None; fills the derived defaults in `args`
    (micro-batch tokens: --seq-len; micro-batches: 1 unless --tokens-per-step derives them)."""
    args.task = getattr(args, "task", "sft")
    refusal = _rollout_tokens(args)
    if refusal is not None:
        return refusal
    if (args.unequal_calls or args.flex) and not plan_trainer(args).flexible_groups:
        flag = "--unequal-calls" if args.unequal_calls else "--flex"
        return (f"{flag} plans flexible SP groups, which {plan_trainer(args).name} (--task {args.task}) does not take: "
                f"it trains on an SPMesh; drop {flag} (flexible groups are planned for --task sft)")
    if getattr(args, "param_offload", "auto") == "yes" and not plan_trainer(args).trainer_options:
        return (f"--param-offload yes: {plan_trainer(args).name} (--task {args.task}) takes no param_offload (its "
                "FSDP2 shards and optimizer states stay on the device); use --param-offload no or auto (auto searches "
                "it off only, for this task)")
    if args.flex and getattr(args, "plot", None) and not _timed(args):
        return (f"--flex --plot weighs flexible groups by modelled seconds; --gpu {args.gpu}: {_timed(args, why=True)}; "
                "drop --flex, or plan for a GPU with measured fractions")
    if args.unequal_calls and args.sync_each_microbatch:
        return ("--unequal-calls syncs gradients in each rank's own last backward; it cannot be combined with "
                "--sync-each-microbatch")
    args.micro_batch_tokens = args.micro_batch_tokens or args.seq_len
    if args.tokens_per_step is not None and args.microbatches is not None:
        return "give --microbatches or --tokens-per-step, not both (the second derives the first per setting)"
    if args.tokens_per_step is None:
        args.microbatches = args.microbatches or 1
    return None


def _timed(args: argparse.Namespace, why: bool = False):
    """Whether --gpu has measured kernel fractions (a step time); with `why`, why not."""
    from hf_longctx.capacity.gpus import gpu

    spec = gpu(getattr(args, "gpu", "h100"))
    return spec.untimed() if why else spec.timed


def _rollout_tokens(args: argparse.Namespace) -> str | None:
    """Fills `args.rollout_tokens` (default: --seq-len for grpo / rloo, 0 otherwise) and
    `args.rollout_tokens_assumed`; why the value is refused, or None. The rollout trainers
    generate on the training GPUs always (their vLLM modes are refused), so a plan without that
    phase (0, or less) would suggest a setting they cannot run."""
    given = getattr(args, "rollout_tokens", None)
    rollouts = args.task in ("grpo", "rloo")
    args.rollout_tokens_assumed = given is None and rollouts
    if given is None:
        args.rollout_tokens = args.seq_len if rollouts else 0
        return None
    if not rollouts:
        return (f"--rollout-tokens {given} applies to --task grpo or rloo, not --task {args.task} (which generates "
                "nothing): drop it")
    if given < 1:
        return (f"--rollout-tokens {given}: {plan_trainer(args).name} (--task {args.task}) generates its rollouts on "
                "the training GPUs, always (use_vllm, server or colocate, is refused), so a plan without them is a "
                "setting it cannot run; give the prompt + completion tokens each GPU generates per step "
                "(per_device_train_batch_size x (prompt + max_completion_length)), or leave --rollout-tokens out "
                f"(default: --seq-len, {args.seq_len})")
    return None

