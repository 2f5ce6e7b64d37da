"""What `checkpoint-N/` adds for exact resume: every rank's FSDP2 shards of model AND optimizer
(torch distributed checkpoint) and the step sampler's position.

Where it sits: called from `LongContextTrainerMixin._save_optimizer_and_scheduler` /
`_load_optimizer_and_scheduler`, i.e. inside the Trainer's own checkpoint bookkeeping
(`checkpoint-N/` naming, `trainer_state.json`, scheduler, per-rank RNG files, rotation,
`resume_from_checkpoint=True` lookup all stay the Trainer's). What the stock Trainer gets
wrong on this stack: with no Accelerate FSDP plugin it `torch.save`s the optimizer state
of rank 0 only -- under ZeRO-3 over DP x SP (USP "Tip 3") every rank holds a different
shard, so the other ranks' moments would be lost. Here each rank writes its own shards with
`torch.distributed.checkpoint` (no rank gathers the full model) and reads them back with
this run's sharding; the sampler state (identical on every rank) is one JSON file.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

DCP_DIR = "hf_longctx_dcp"
SAMPLER_FILE = "hf_longctx_sampler.json"


def save_sharded(output_dir: str, model: torch.nn.Module, optimizer: Any, sampler: Any, *, is_main: bool) -> None:
    """Save model + optimizer shards and the sampler position into `output_dir`. A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    optimizer = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps the torch one
    model_sd, optim_sd = get_state_dict(model, optimizer)  # DTensor shards under FSDP2, plain tensors in one process
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(output_dir, DCP_DIR))
    if is_main:
        with open(os.path.join(output_dir, SAMPLER_FILE), "w") as f:
            json.dump(sampler.state_dict(), f)


def load_sharded(checkpoint: str, model: torch.nn.Module, optimizer: Any, sampler: Any) -> None:
    """Restore what `save_sharded` wrote, with the same world size and mesh degrees. A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = os.path.join(checkpoint, DCP_DIR)
    sampler_file = os.path.join(checkpoint, SAMPLER_FILE)
    if not os.path.isdir(path) or not os.path.isfile(sampler_file):
        raise ValueError(
            f"{checkpoint} has no {DCP_DIR}/ or {SAMPLER_FILE}: it was not written by a LongContextTrainer "
            "(or saving crashed); resume from a complete checkpoint"
        )
    optimizer = getattr(optimizer, "optimizer", optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # templates with this run's sharding
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
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
