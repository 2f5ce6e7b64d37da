"""Start `world` spawned ranks for a benchmark and wait for rank 0's result, within a bound.

Where it sits: the process launcher the multi-rank benchmarks share (`hot_path.py`,
`memory.py`, `mixers.py`, ...). Each rank runs `worker(rank, init_file, args, results)`;
rank 0 puts one result on the queue. A rank that dies (e.g. killed for memory) ends the
wait with its exit code; ranks that have not answered after `timeout` seconds (a hang in a
collective) are killed and the wait ends with one line naming them and the bound, instead
of leaving the parent blocked forever.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time

import torch.multiprocessing as mp

DEFAULT_TIMEOUT = 1800.0  # seconds: the longest benchmark here takes a few minutes on 2 loaded cores


def run_ranks(worker, world: int, args, *, timeout: float = DEFAULT_TIMEOUT):
    fd, init_file = tempfile.mkstemp(prefix="hf_longctx_bench_")
    os.close(fd)
    os.unlink(init_file)  # the FileStore creates it
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, init_file, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    name = getattr(worker, "__qualname__", repr(worker))
    try:
        while True:
            try:
                out = results.get(timeout=min(10.0, max(0.1, deadline - time.monotonic())))
                break
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise SystemExit(f"a benchmark rank died with exit code {dead[0]} (killed for memory?)")
                if time.monotonic() >= deadline:
                    alive = [r for r, p in enumerate(procs) if p.is_alive()]
                    raise SystemExit(f"TIMED OUT after {timeout:g}s: ranks {alive} of {world} running {name} did not finish")
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        if alive:
            print(f"TIMED OUT after {timeout:g}s: ranks {alive} of {world} running {name} did not exit after rank 0's "
                  "result (killed)", flush=True)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return out


def rows_of(worker, world: int, args):
    """Rank 0's result: `worker` run in this process for one rank (no spawn, easier to profile),
    else on `world` spawned ranks through `run_ranks`."""
    if world == 1:
        q: queue.Queue = queue.Queue()
        worker(0, "", args, q)
        return q.get()
    return run_ranks(worker, world, args)
