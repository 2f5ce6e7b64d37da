"""Files the ranks of a launched recipe share: who writes them, who waits, what every rank checks.

Where it sits: before the training data flow, in the recipes (`common.load_model_and_data` for
dpo/grpo/rloo, `demo.py`, `sft.py`, `pretrain.py`/`lora.py`). The rule holds on one node or many:

- What a recipe builds itself (the demo's tokenizer and model, the post-training recipes' tiny
  Llama) is built once per job, by global rank 0, under OUTPUT_DIR, while every other rank waits
  in a collective (`build_once`). Every rank then checks that it reads rank 0's build (a fresh
  token rank 0 writes beside it): a node whose OUTPUT_DIR is its own disk, or holds an older
  build, stops the whole job with the path and the fix (an --output-dir every node mounts, or a
  prebuilt --model every node can read), on every rank at once. Building once per node instead
  would need identical builds on every node, and the demo's tokenizer is trained on each node's
  own Python standard library, so the recipes do not do it.
- What a library caches when it is missing (`datasets` downloads and `map` results, hub
  downloads) is filled in turn (`fill_caches_in_turn`): global rank 0 first, then the first rank
  of every other node, then the rest. A cache all nodes share is filled once per job, a
  node-local one once per node, and no two ranks fill one cache at the same time (TRL prepares
  its datasets in the same order).

`TrainingArguments.main_process_first()` lets the first rank of EVERY node in at once (local=True
by default), so it cannot guard a build that only global rank 0 makes.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

STAMP = "build_stamp.json"  # written by rank 0 into the built directory; its token is fresh per job


def _group() -> Any:
    """torch.distributed when this process is one of several ranks, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


@contextmanager
def fill_caches_in_turn() -> Iterator[None]:
    """Global rank 0 runs the block first, then the first rank (LOCAL_RANK 0) of every other node,
    then every other rank; one process: just the block. The waits are global barriers, passed
    also when the block raises, so a failing block fails on every rank instead of leaving the
    others waiting for the process-group timeout."""
    dist = _group()
    if dist is None:
        yield
        return
    first = dist.get_rank() == 0
    node_first = not first and int(os.environ.get("LOCAL_RANK", "0")) == 0
    if not first:
        dist.barrier()  # rank 0 has filled the caches
    if not first and not node_first:
        dist.barrier()  # the first rank of every node has filled its node's caches
    try:
        yield
    finally:
        if first:
            dist.barrier()
            dist.barrier()
        elif node_first:
            dist.barrier()


def _seen(directory: str, token: str) -> str:
    """What this rank reads in `directory`: "same" (the stamp with `token`), "older" (another stamp)
    or "missing"."""
    try:
        with open(os.path.join(directory, STAMP)) as f:
            return "same" if json.load(f).get("token") == token else "older"
    except (OSError, ValueError):
        return "missing"


def build_once(directory: str, build: Callable[[], None], *, what: str, fix: str) -> None:
    """Global rank 0 runs `build()`, which writes `what` under `directory`; the other ranks wait.
    Returns on every rank once every rank reads rank 0's build there; otherwise raises SystemExit
    on every rank, naming the directory, the ranks and hosts that do not see it, and `fix`. When
    `build()` raises on rank 0, rank 0 re-raises it and the other ranks exit naming it."""
    dist = _group()
    if dist is None:
        build()
        return
    rank, error = dist.get_rank(), None
    sent: list = [None]
    if rank == 0:
        try:
            build()
            token = uuid.uuid4().hex
            with open(os.path.join(directory, STAMP), "w") as f:
                json.dump({"token": token, "what": what}, f)
            sent = [(token, None)]
        except Exception as e:  # every rank learns of it below, instead of waiting for the timeout
            error, sent = e, [(None, f"{type(e).__name__}: {e}")]
    dist.broadcast_object_list(sent, src=0)  # the other ranks wait here while rank 0 builds
    token, failure = sent[0]
    if error is not None:
        raise error
    if failure is not None:
        raise SystemExit(f"rank 0 failed to build {what} in {directory}: {failure}")
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, (_seen(directory, token), socket.gethostname(), os.path.abspath(directory)))
    blind = [(r, v) for r, v in enumerate(views) if v[0] != "same"]
    if blind:
        ranks = ", ".join(str(r) for r, _ in blind)
        hosts = ", ".join(sorted({v[1] for _, v in blind}))
        older = " (it holds an older build)" if any(v[0] == "older" for _, v in blind) else ""
        raise SystemExit(
            f"{what} that rank 0 built in {views[0][2]} (host {views[0][1]}) is not there for rank(s) {ranks} "
            f"(host(s) {hosts}){older}: that directory is not on a file system every node shares. Fix: {fix}"
        )
