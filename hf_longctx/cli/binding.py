"""Which limit binds a plan, in words that name the flags that change it: the closest setting
when nothing fits (GPU memory, host memory) and how close the suggestion comes to each limit.

Where it sits: the last lines of `hf-longctx plan` (`cli/capacity.py`), read from a
`capacity/search.Candidate` and the plan's flags; it estimates nothing itself.
"""

from __future__ import annotations

import argparse

from hf_longctx.cli.inputs import gib
from hf_longctx.cli.plan_flags import plan_trainer, syncs_each_microbatch


def binding_advice(args: argparse.Namespace, c) -> str:
    """Which resource rules out `c` (the setting closest to fitting) and the flags that change it."""
    usable = 1 - args.headroom
    if c.binding in ("host memory", "GPU and host memory"):
        host = (f"HOST memory binds: {gib(c.memory.host * min(args.gpus, args.gpus_per_node))} GiB per node needed, "
                f"{gib(args.host_memory * usable)} GiB usable of --host-memory {gib(args.host_memory)} GiB; raise "
                "--host-memory, or offload less (--param-offload no, a lighter memory preset) with more GPU memory")
        if c.binding == "host memory":
            return host + " (this setting fits the GPU)"
        return host + "; and " + gpu_advice(args, c)
    return gpu_advice(args, c)


def gpu_advice(args: argparse.Namespace, c) -> str:
    usable = 1 - args.headroom
    flags = ["--gpu-memory", "more --gpus"]
    if args.param_offload == "no" and plan_trainer(args).trainer_options:
        flags.append("--param-offload auto (parameters, gradients and optimizer states on host)")
    if c.memory.held and not syncs_each_microbatch(args) and not args.unequal_calls:
        flags.append(f"--sync-each-microbatch ({gib(c.memory.held)} GiB are fp32 gradients held unsharded until the "
                     f"step's last backward; {plan_trainer(args).name}(sync_each_microbatch=True) shards them)")
    if c.microbatches > 1:
        flags.append(f"fewer micro-batches per step (now {c.microbatches}: --microbatches / --tokens-per-step)")
    flags.append("a shorter --seq-len / --micro-batch-tokens")
    return (f"GPU memory binds: {gib(c.memory.peak)} GiB per GPU needed, {gib(args.gpu_memory * usable)} GiB usable "
            f"of --gpu-memory {gib(args.gpu_memory)} GiB; change " + ", ".join(flags))


def fit_line(args: argparse.Namespace, c) -> str:
    """How close the suggestion is to each limit (which one binds first)."""
    usable = 1 - args.headroom
    gpu = c.memory.peak / (args.gpu_memory * usable)
    host = c.memory.host * min(args.gpus, args.gpus_per_node) / (args.host_memory * usable)
    which = "GPU memory (--gpu-memory)" if gpu >= host else "host memory (--host-memory)"
    return (f"uses {gpu:.0%} of the usable GPU memory and {host:.0%} of the usable host memory: {which} binds first")
