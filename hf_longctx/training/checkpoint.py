"""Sharded checkpoints that resume exactly: model, optimizer, scheduler, sampler, RNG.

Where it sits: called by `training/loop.py` every `save_every` steps and once at start
(resume). Model and optimizer states are saved SHARDED with `torch.distributed.checkpoint`
(each rank writes its own FSDP2 shards -- ZeRO-3 over DP × SP, USP "Tip 3" -- no rank
gathers the full model); the small per-rank rest (scheduler, step sampler, step counter and
every RNG: Python, NumPy, torch CPU, CUDA) goes to `rank{r}.pt`. A run stopped after step n
and resumed from that checkpoint draws the same documents, the same plan and the same
random numbers as an uninterrupted run, so its loss trajectory is identical (fp32).

Layout: `<output_dir>/step_{n:08d}/` with the DCP files, `rank{r}.pt` per rank and a `DONE`
marker written by rank 0 after every rank finished; a checkpoint without it (a crash while
saving) is ignored by `latest_checkpoint`.
"""

from __future__ import annotations

import os
import random
import re
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

_DIR = re.compile(r"^step_(\d{8})$")
_MARKER = "DONE"


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def checkpoint_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"step_{step:08d}")


def latest_checkpoint(output_dir: str | None) -> str | None:
    """The newest complete checkpoint under `output_dir`, or None."""
    if not output_dir or not os.path.isdir(output_dir):
        return None
    done = [
        (int(m.group(1)), name)
        for name in os.listdir(output_dir)
        if (m := _DIR.match(name)) and os.path.exists(os.path.join(output_dir, name, _MARKER))
    ]
    return os.path.join(output_dir, max(done)[1]) if done else None


def save_checkpoint(
    output_dir: str, step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, sampler: Any
) -> str:
    """Save everything a resume needs after `step` completed steps. A collective: call it
    on every rank. Returns the checkpoint directory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank, world = _rank_world()
    path = checkpoint_dir(output_dir, step)
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        # Saving over an earlier checkpoint of this step: it is incomplete until the new marker.
        if os.path.exists(os.path.join(path, _MARKER)):
            os.remove(os.path.join(path, _MARKER))
    _barrier()  # nobody writes before the old marker is gone
    model_sd, optim_sd = get_state_dict(model, optimizer)  # sharded (DTensor) under FSDP2
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    torch.save(
        {
            "step": step,
            "world_size": world,
            "scheduler": scheduler.state_dict(),
            "sampler": sampler.state_dict(),
            "rng": _rng_state(),
        },
        os.path.join(path, f"rank{rank}.pt"),
    )
    _barrier()  # the marker must not exist before every rank's files do
    if rank == 0:
        with open(os.path.join(path, _MARKER), "w") as f:
            f.write(f"{step}\n")
    _barrier()
    return path


def load_checkpoint(
    path: str, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, sampler: Any
) -> int:
    """Restore a checkpoint saved by `save_checkpoint` with the same world size and mesh;
    returns the number of completed steps. A collective: call it on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank, world = _rank_world()
    local = os.path.join(path, f"rank{rank}.pt")
    if not os.path.exists(os.path.join(path, _MARKER)) or not os.path.exists(local):
        raise ValueError(f"{path} is not a complete checkpoint for rank {rank} (missing {_MARKER} or rank{rank}.pt)")
    extra = torch.load(local, weights_only=False)  # our own file: pickled RNG states
    if extra["world_size"] != world:
        raise ValueError(
            f"checkpoint {path} was saved by {extra['world_size']} ranks, this job has {world}; "
            "resume with the same number of processes and the same ulysses/ring degrees"
        )
    model_sd, optim_sd = get_state_dict(model, optimizer)  # templates with this run's sharding
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(extra["scheduler"])
    sampler.load_state_dict(extra["sampler"])
    _set_rng_state(extra["rng"])
    return int(extra["step"])
