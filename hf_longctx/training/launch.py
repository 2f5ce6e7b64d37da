"""Process setup of a recipe: this rank's device and the process group, before `TrainingArguments`.

Where it sits: the first lines of every recipe. `torchrun` / `accelerate launch` start the
ranks and set RANK, LOCAL_RANK, WORLD_SIZE; here each rank selects its GPU from LOCAL_RANK
(`torch.cuda.set_device`, so NCCL and FSDP2 use the right device) and initialises the process
group itself -- NCCL on CUDA, gloo on CPU -- with the fault timeout of `training/faults.py`
(Accelerate passes `ddp_timeout` on GPUs only; on CPU the default is 30 minutes). Then
`TrainingArguments` finds the group already initialised and adopts it, and
`init_sequence_parallel` builds the dp × ring × ulysses mesh (USP paper §3) over it.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from hf_longctx.distributed.flex.bank import GroupBank
from hf_longctx.distributed.mesh import SPMesh


def init_distributed(timeout_s: float = 1800.0) -> torch.device:
    """This rank's device; initialises the default process group when launched with several ranks."""
    import torch.distributed as dist

    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=float(timeout_s)),
            device_id=device if device.type == "cuda" else None,
        )
    return device


def describe(mesh: SPMesh | GroupBank, device: torch.device) -> str:
    """One line naming the launch: backend, world and the mesh factorisation (for a group
    bank: every group size with its Ulysses × ring split)."""
    import torch.distributed as dist

    backend = dist.get_backend() if dist.is_initialized() else "none"
    if isinstance(mesh, GroupBank):
        sizes = ", ".join(
            f"{s.size} (ulysses {s.ulysses} x ring {s.ring}{f' x fpdt_chunks {s.fpdt_chunks}' if s.fpdt_chunks > 1 else ''})"
            for s in mesh.shapes
        )
        return (f"{mesh.world_size} rank(s) on {device.type} ({backend}): flexible SP groups of sizes {sizes}, "
                f"chosen per micro-batch slot; FSDP2 shards over all {mesh.world_size}")
    return (
        f"{mesh.world_size} rank(s) on {device.type} ({backend}): dp {mesh.dp} x ring {mesh.ring} x "
        f"ulysses {mesh.ulysses}{f' x fpdt_chunks {mesh.fpdt_chunks}' if mesh.fpdt_chunks > 1 else ''}; "
        f"FSDP2 shards over all {mesh.world_size}"
    )


def shutdown_distributed() -> None:
    """Destroy the default process group before the interpreter exits (a local call, no
    collective). Left to interpreter teardown, gloo's worker threads can still be joinable when
    their C++ objects are destroyed, and the process aborts with "terminate called without an
    active exception" (seen at the end of recipes/grpo.py on torch 2.11, and in the
    unequal-calls demo under load) -- after a run that had finished its work."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
