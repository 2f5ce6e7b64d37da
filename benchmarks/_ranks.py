"""Start `world` spawned ranks for a benchmark and wait for rank 0's result.

Where it sits: the process launcher the multi-rank benchmarks share (`memory.py`,
`mixers.py`). Each rank runs `worker(rank, init_file, args, results)`; rank 0 puts one
result on the queue. A rank that dies (e.g. killed for memory) ends the wait with its
exit code instead of leaving the parent blocked forever.
"""

from __future__ import annotations

import os
import queue
import tempfile

import torch.multiprocessing as mp


def run_ranks(worker, world: int, args):
    fd, init_file = tempfile.mkstemp(prefix="hf_longctx_bench_")
    os.close(fd)
    os.unlink(init_file)  # the FileStore creates it
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, init_file, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    while True:
        try:
            out = results.get(timeout=10)
            break
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise SystemExit(f"a benchmark rank died with exit code {dead[0]} (killed for memory?)")
    for p in procs:
        p.join()
    return out
