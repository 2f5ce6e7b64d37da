"""Refusals: `TrainingArguments` (and TRL `SFTConfig`) settings that would silently break the
exact-loss contract of `LongContextTrainerMixin`, or be silently ignored by it.

Where it sits: the first thing the trainer's `__init__` runs, on every rank alike and
before any collective, so a bad setting is one clear `ValueError` everywhere instead of a
hang or a wrong gradient. The contract (DESIGN invariant 6): every rank's loss is its token-
loss sum divided by the step's GLOBAL target count, micro-batch and rank gradients are
SUMMED; one optimizer step = one planned step of `tokens_per_step` tokens.
"""

from __future__ import annotations

from typing import Any

from hf_longctx.errors import NotSupported
from hf_longctx.training.refusals.training_arguments import refused_arguments, refused_parameters, refused_sft_fields

def check_training_arguments(args: Any, trainer: str = "LongContextTrainer") -> None:
    """Raise one `NotSupported` listing every refused setting of `args` (the table of
    `arguments.py`, plus TRL's SFTConfig fields), each with why and what to use instead;
    `trainer`: the class the message names."""
    errors = refused_arguments(args)
    if args.n_gpu > 1:
        errors.append(
            f"n_gpu={args.n_gpu} (nn.DataParallel in one process); do instead: launch one process per device "
            "(torchrun / accelerate launch)"
        )
    errors += refused_sft_fields(args)
    if errors:
        raise NotSupported(
            f"{trainer} cannot honour these {type(args).__name__} settings:\n- " + "\n- ".join(errors),
            "change the settings listed above as each line says",
        )


def check_trainer_parameters(params: dict[str, Any]) -> None:
    """Raise one `NotSupported` for the `Trainer.__init__` parameters the mixin refuses
    (`arguments.TRAINER_PARAMETERS`), before the Trainer is built."""
    errors = refused_parameters(params)
    if errors:
        raise NotSupported("LongContextTrainer:\n- " + "\n- ".join(errors), "change the parameters listed above as each line says")


def check_process_group(args: Any) -> None:
    """TrainingArguments must see the process group the mesh was built on."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if args.world_size != world or (world > 1 and args.process_index != dist.get_rank()):
        raise ValueError(
            f"TrainingArguments see world_size={args.world_size} (process {args.process_index}) but torch.distributed "
            f"has {world} rank(s): Accelerate reads the launcher's environment (RANK, LOCAL_RANK, WORLD_SIZE, "
            "LOCAL_WORLD_SIZE); launch with torchrun / accelerate launch, or, for a process group you initialised "
            "yourself, set those variables before creating TrainingArguments (on CPU also use_cpu=True)"
        )


def check_world(mesh_world: int) -> None:
    """The mesh and torch.distributed agree on the world: a mesh built on another process group,
    or before one existed (a world of 1 on every rank, each training the whole step alone)."""
    from hf_longctx.distributed.mesh import process_group_world

    _, world = process_group_world("LongContextTrainer")  # refuses a launch with WORLD_SIZE > 1 and no group
    if mesh_world != world:
        raise NotSupported(
            f"the mesh spans {mesh_world} rank(s) but torch.distributed has {world}: the mesh was built before the "
            "process group (or on another one), so the ranks would not share the step",
            "create TrainingArguments (which initialises the process group under torchrun / accelerate launch) or call "
            "torch.distributed.init_process_group() BEFORE hf_longctx.init_sequence_parallel / init_group_bank, then "
            "patch the model with that mesh",
        )
