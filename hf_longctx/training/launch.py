"""Process setup of a recipe: the `Accelerator` (process group with a fault timeout) and the SP mesh.

Where it sits: the first lines of every recipe, before the model is loaded. `accelerate
launch` (or torchrun) starts the ranks; `Accelerator` initialises the process group --
gloo on CPU, NCCL on CUDA -- with the collective timeout of `training/faults.py`; then
`init_sequence_parallel` builds the dp × ring × ulysses mesh (USP paper §3) over it.
Accelerate's own `ParallelismConfig` is not used: it has no dimension for a third-party SP.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_longctx.distributed.mesh import SPMesh, init_sequence_parallel
from hf_longctx.training.faults import process_group_kwargs


def setup_distributed(
    *, ulysses: int = 1, ring: int = 1, fpdt_chunks: int = 1, timeout_s: float = 600.0, seed: int = 0
) -> tuple[Any, SPMesh]:
    """(accelerator, mesh) for this rank. `timeout_s`: how long a collective may block
    before every rank stops with an error (a dead peer)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    # cpu=True on a machine without CUDA: Accelerate otherwise leaves a torchrun-started
    # CPU job un-initialised (DistributedType.NO) and every rank would train alone.
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=[process_group_kwargs(timeout_s)])
    set_seed(seed)
    mesh = init_sequence_parallel(ulysses_degree=ulysses, ring_degree=ring, fpdt_chunks=fpdt_chunks)
    return accelerator, mesh


def describe(accelerator: Any, mesh: SPMesh) -> str:
    """One line naming the launch: backend, world and the mesh factorisation."""
    import torch.distributed as dist

    backend = dist.get_backend() if dist.is_initialized() else "none"
    return (
        f"{mesh.world_size} rank(s) on {accelerator.device.type} ({backend}): dp {mesh.dp} x ring {mesh.ring} x "
        f"ulysses {mesh.ulysses}{f' x fpdt_chunks {mesh.fpdt_chunks}' if mesh.fpdt_chunks > 1 else ''}; "
        f"FSDP2 shards over all {mesh.world_size}"
    )
