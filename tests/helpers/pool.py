"""A persistent pool of N gloo worker processes for distributed tests.

Spawning N ranks costs seconds on a 2-core machine (each imports torch), so every
distributed test of a session runs on the same N processes: the parent sends a picklable
module-level function and its arguments to every rank, each rank runs it inside its
already-initialised gloo process group, and the parent gathers the per-rank results (or
the tracebacks). A task that does not finish within its timeout (a hang in a collective)
kills the pool and raises; the next test gets a fresh pool.

Task functions call `worker_mesh(...)` to get an SP mesh: meshes are cached per worker
process (group creation is collective and slow on gloo), keyed by degrees.

`backend="nccl"` (or "cpu:gloo,cuda:nccl"; tests/gpu/test_multi_gpu.py): the same pool on
GPUs, rank r on cuda:r, selected with `torch.cuda.set_device` before the group is created
(NCCL binds its communicator to the current device); tasks place their tensors on
`torch.cuda.current_device()`. The default stays gloo on CPU.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import sys
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.multiprocessing as mp


class WorkerState:
    """Per-process cache of meshes; lives only inside a worker process."""

    meshes: dict = {}
    banks: dict = {}


def worker_mesh(ulysses: int, ring: int, fpdt_chunks: int = 1):
    """The SP mesh for these degrees in the current worker (created once, then cached)."""
    from hf_longctx.distributed.mesh import init_sequence_parallel

    key = (ulysses, ring)
    if key not in WorkerState.meshes:
        WorkerState.meshes[key] = init_sequence_parallel(ulysses, ring)
    return dataclasses.replace(WorkerState.meshes[key], fpdt_chunks=fpdt_chunks)


def worker_bank(heads: int, ranks_per_node: int, fpdt_chunks: int = 1, min_size: int = 1):
    """The group bank for these settings in the current worker (created once, then cached)."""
    from hf_longctx.flex.bank import init_group_bank

    key = (heads, ranks_per_node, fpdt_chunks, min_size)
    if key not in WorkerState.banks:
        WorkerState.banks[key] = init_group_bank(
            heads=heads, ranks_per_node=ranks_per_node, fpdt_chunks=fpdt_chunks, min_size=min_size
        )
    return WorkerState.banks[key]


def _worker(rank: int, world: int, init_file: str, tasks, results, backend: str = "gloo") -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    if "nccl" in backend:  # "nccl" or a per-device string such as "cpu:gloo,cuda:nccl"
        torch.cuda.set_device(rank)  # before the group: NCCL's communicator uses the current device
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    while True:
        item = tasks.get()
        if item is None:
            break
        task_id, fn, args, kwargs = item
        try:
            results.put((task_id, rank, True, fn(*args, **kwargs)))
        except BaseException:  # report every failure to the parent, keep serving
            results.put((task_id, rank, False, traceback.format_exc()))
        finally:
            _forget_accelerator_state()
    dist.destroy_process_group()


def _forget_accelerator_state() -> None:
    """After each task: Accelerate's process-wide state (a Trainer's or an Accelerator's
    mixed precision, set once per process) cleared, so the pool's next task -- another test
    -- builds its Accelerator with its own settings whatever ran before it."""
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)


class GlooPool:
    def __init__(self, world_size: int, timeout: float = 180.0, backend: str = "gloo"):
        if "nccl" in backend and torch.cuda.device_count() < world_size:
            raise RuntimeError(f"an NCCL pool of {world_size} ranks needs {world_size} GPUs, {torch.cuda.device_count()} visible")
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        ctx = mp.get_context("spawn")
        fd, self._init_file = tempfile.mkstemp(prefix="hf_longctx_pool_")
        os.close(fd)
        os.unlink(self._init_file)  # the FileStore creates it
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, self._init_file, self._tasks[r], self._results, backend), daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._next_id = 0
        self.broken = False

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        """Run fn(*args, **kwargs) on every rank; return the results ordered by rank."""
        if self.broken:
            raise RuntimeError("pool is broken")
        self._next_id += 1
        task_id = self._next_id
        for q in self._tasks:
            q.put((task_id, fn, args, kwargs))
        out: dict[int, object] = {}
        errors: dict[int, str] = {}
        limit = self.timeout if timeout is None else timeout
        while len(out) + len(errors) < self.world_size:
            try:
                tid, rank, ok, value = self._results.get(timeout=limit)
            except queue.Empty:
                self.close()
                missing = sorted(set(range(self.world_size)) - set(out) - set(errors))
                raise TimeoutError(f"ranks {missing} did not finish {fn.__name__} within {limit}s (hang?)") from None
            if tid != task_id:
                continue
            (out if ok else errors)[rank] = value
        if errors:
            msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"{fn.__name__} failed on ranks {sorted(errors)}:\n{msg}")
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        self.broken = True
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        if os.path.exists(self._init_file):
            os.unlink(self._init_file)


class PoolRegistry:
    """One pool per (world size, backend) for the test session, rebuilt after a hang."""

    def __init__(self):
        self._pools: dict[tuple[int, str], GlooPool] = {}

    def get(self, world_size: int, backend: str = "gloo") -> GlooPool:
        pool = self._pools.get((world_size, backend))
        if pool is None or pool.broken:
            pool = self._pools[(world_size, backend)] = GlooPool(world_size, backend=backend)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
