"""Process setup and end of a recipe: this rank's device and the process group, before
`TrainingArguments`; a clean exit after the work (`run_rank`).

Where it sits: the first lines of every recipe. `torchrun` / `accelerate launch` start the
ranks and set RANK, LOCAL_RANK, WORLD_SIZE; here each rank selects its GPU from LOCAL_RANK
(`torch.cuda.set_device`, so NCCL and FSDP2 use the right device) and initialises the process
group itself -- NCCL on CUDA, gloo on CPU -- with the fault timeout of `training/base/faults.py`
(Accelerate passes `ddp_timeout` on GPUs only; on CPU the default is 30 minutes). Then
`TrainingArguments` finds the group already initialised and adopts it, and
`init_sequence_parallel` builds the dp × ring × ulysses mesh (USP paper §3) over it.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import NoReturn

import torch

from hf_longctx.flex.bank import GroupBank
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


def placement(world_size: int, param_offload: bool) -> str:
    """Where the trainer keeps the parameters: FSDP2 over the world, or one process's device."""
    offload = "; parameters, gradients and optimizer states in host memory" if param_offload else ""
    if world_size > 1 or param_offload:
        return f"FSDP2 shards over all {world_size}{offload}"
    return "one process: the model whole on its device (nothing to shard)"


def describe(mesh: SPMesh | GroupBank, device: torch.device, *, param_offload: bool = False) -> str:
    """One line naming the launch: backend, world, the mesh factorisation (for a group bank:
    every group size with its Ulysses × ring split) and where the parameters live."""
    import torch.distributed as dist

    backend = dist.get_backend() if dist.is_initialized() else "none"
    if isinstance(mesh, GroupBank):
        sizes = ", ".join(
            f"{s.size} (ulysses {s.ulysses} x ring {s.ring}{f' x fpdt_chunks {s.fpdt_chunks}' if s.fpdt_chunks > 1 else ''})"
            for s in mesh.shapes
        )
        return (f"{mesh.world_size} rank(s) on {device.type} ({backend}): flexible SP groups of sizes {sizes}, "
                f"chosen per micro-batch slot; {placement(mesh.world_size, param_offload)}")
    return (
        f"{mesh.world_size} rank(s) on {device.type} ({backend}): dp {mesh.dp} x ring {mesh.ring} x "
        f"ulysses {mesh.ulysses}{f' x fpdt_chunks {mesh.fpdt_chunks}' if mesh.fpdt_chunks > 1 else ''}; "
        f"{placement(mesh.world_size, param_offload)}"
    )


def shutdown_distributed() -> None:
    """Destroy the default process group and every group made from it (a local call, no
    collective). This does not stop gloo's worker threads of groups that something still
    references (a mesh, FSDP2, DTensor): see `run_rank` for why that matters at exit."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_rank(code: int = 0) -> NoReturn:
    """End a launched rank whose work is done, without interpreter finalisation.

    Why: a gloo worker thread (`ProcessGroupGloo::runLoop`) drops its reference to a finished
    collective after the waiting rank has moved on. When that is the last reference, the
    collective's tensors release their Python objects, which needs the GIL. If the main thread
    has reached `Py_FinalizeEx` by then, Python (3.11) ends the worker with `pthread_exit`; the
    forced unwind crosses the collective's noexcept destructor and the process aborts with
    "terminate called without an active exception" after every step has finished (captured in
    a core dump of recipes/demo.py under torch 2.11 on 2 loaded cores: worker in
    `~AsyncAllgatherWork` -> `decref_pyobject` -> `take_gil` -> `PyThread_exit_thread`, main
    thread in `Py_FinalizeEx`). `destroy_process_group` does not join those threads while
    meshes, FSDP2 or DTensor still hold the groups, so a rank skips finalisation instead: it
    destroys the groups, joins its non-daemon Python threads, runs the `atexit` handlers
    (logging, trackers), flushes stdout/stderr and leaves with `os._exit(code)`.

    Args:
        code: The process's exit status.
    """
    shutdown_distributed()
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # what interpreter exit would run first; os._exit skips it
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing left to flush
            pass
    os._exit(code)


def run_rank(main: Callable[[], object]) -> NoReturn:
    """Run a launched script's `main()` and end the rank with `exit_rank(0)`; if `main` raises
    (SystemExit included, e.g. argparse's --help), destroy the process group and let the
    exception end the process as usual (its traceback and exit code unchanged).

    Args:
        main: The script's entry point, called without arguments.
    """
    try:
        main()
    except BaseException:
        shutdown_distributed()
        raise
    exit_rank(0)
