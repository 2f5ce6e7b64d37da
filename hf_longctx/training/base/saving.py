"""What `checkpoint-N/` adds for exact resume: every rank's FSDP2 shards of model AND optimizer
(torch distributed checkpoint) and the step sampler's position.

Where it sits: called from the trainers' `_save_optimizer_and_scheduler` /
`_load_optimizer_and_scheduler`, inside the Trainer's own checkpoint bookkeeping (naming,
`trainer_state.json`, scheduler, RNG files, rotation stay the Trainer's). Guarantee: each
rank writes and reads its own shards (no rank gathers the full model; the stock Trainer
would save rank 0's optimizer state only, losing the other shards' moments under ZeRO-3);
the sampler state, identical on every rank, is one JSON file."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

DCP_DIR = "hf_longctx_dcp"
SAMPLER_FILE = "hf_longctx_sampler.json"


def save_sharded(output_dir: str, model: torch.nn.Module, optimizer: Any, sampler: Any, *, is_main: bool) -> None:
    """Save model + optimizer shards and the sampler position into `output_dir`. A collective.
    `sampler=None`: no sampler file (a trainer whose data position the Trainer's own batch skip restores)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    optimizer = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps the torch one
    model_sd, optim_sd = get_state_dict(model, optimizer)  # DTensor shards under FSDP2, plain tensors in one process
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(output_dir, DCP_DIR))
    if is_main and sampler is not None:
        with open(os.path.join(output_dir, SAMPLER_FILE), "w") as f:
            json.dump(sampler.state_dict(), f)


def load_sharded(checkpoint: str, model: torch.nn.Module, optimizer: Any, sampler: Any) -> None:
    """Restore what `save_sharded` wrote, with the same world size and mesh degrees. A collective.
    `sampler=None`: nothing to restore besides the shards (see `save_sharded`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = os.path.join(checkpoint, DCP_DIR)
    sampler_file = os.path.join(checkpoint, SAMPLER_FILE)
    if not os.path.isdir(path) or (sampler is not None and not os.path.isfile(sampler_file)):
        raise ValueError(
            f"{checkpoint} has no {DCP_DIR}/ or {SAMPLER_FILE}: it was not written by a LongContextTrainer "
            "(or saving crashed); resume from a complete checkpoint"
        )
    optimizer = getattr(optimizer, "optimizer", optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # templates with this run's sharding
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if sampler is not None:
        with open(sampler_file) as f:
            sampler.load_state_dict(json.load(f))


def save_consolidated(model: torch.nn.Module, output_dir: str, *, is_main: bool, **save_kwargs: Any) -> None:
    """Gather the full model once (a collective) and `save_pretrained` it on the main rank; the
    directory loads with `from_pretrained`, unpatched (for a PEFT model: the adapter)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # The config's attention implementation (our per-patch name) is not serialised by
    # transformers (`_attn_implementation_internal`), so the directory loads unpatched.
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if is_main:
        os.makedirs(output_dir, exist_ok=True)
        model.save_pretrained(output_dir, state_dict=state, **save_kwargs)


# ---- the Trainer's checkpoint hooks (`LongContextTrainerMixin`) --------------------------------
SCHEDULER_NAME = "scheduler.pt"  # the Trainer's own file name


def save_step_state(output_dir: str, model: torch.nn.Module, optimizer: Any, scheduler: Any, sampler: Any, *,
                    is_main: bool, step: int, paused: Any) -> None:
    """`_save_optimizer_and_scheduler`: every rank's shards of model and optimizer + the sampler
    position; the scheduler as the Trainer saves it. `paused`: a context in which a watchdog
    does not count (saving is no step)."""
    from hf_longctx.training.base.faults import comm_guard

    os.makedirs(output_dir, exist_ok=True)
    with comm_guard(step), paused:
        save_sharded(output_dir, model, optimizer, sampler, is_main=is_main)
    if is_main:
        torch.save(scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))


def load_step_state(checkpoint: str | None, model: torch.nn.Module, optimizer: Any, scheduler: Any,
                    sampler: Any) -> None:
    """`_load_optimizer_and_scheduler`: the weights come back here too (one distributed-checkpoint
    read, after the optimizer exists), with the optimizer state, sampler position and scheduler."""
    if checkpoint is None:
        return
    load_sharded(checkpoint, model, optimizer, sampler)
    scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))


def save_trained_model(model: torch.nn.Module, output_dir: str, config: Any, *, use_cache: bool | None,
                       processing_class: Any, args: Any, paused: Any) -> None:
    """`save_model`: `save_pretrained` of the consolidated model (loads unpatched with
    `from_pretrained`), with `config.use_cache` as the user loaded it (`use_cache`; the Trainer
    writes its training-time value into the config), the processing class and the training
    arguments."""
    trained_value = getattr(config, "use_cache", None)
    if config is not None and use_cache is not None:
        config.use_cache = use_cache  # the model as loaded, not the Trainer's training-time value
    try:
        with paused:
            save_consolidated(model, output_dir, is_main=args.should_save)
    finally:
        if config is not None and trained_value is not None:
            config.use_cache = trained_value
    if args.should_save:
        if processing_class is not None:
            processing_class.save_pretrained(output_dir)
        torch.save(args, os.path.join(output_dir, "training_args.bin"))
