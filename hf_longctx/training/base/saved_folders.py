"""When a `checkpoint-N/` folder counts: only once every rank's part of it is on disk.

Where it sits: around the Trainer's `_save_checkpoint` in `SPTrainerBase` (every trainer of
this package), read by `resume_choice.resolve_resume` and by the rotation under
`save_total_limit`. Guarantee: before any rank writes into the folder, the main process marks
it as being written (`MARK_FILE`, `{"complete": false}`) and every rank waits for that mark; after
every rank has written its files (a barrier), the main process replaces the mark atomically with
`{"complete": true}`. A rank killed in between leaves the folder marked incomplete, whatever
files it holds (the Trainer's own `trainer_state.json` included, which rank 0 writes without
waiting for the other ranks' RNG files). Rotation counts complete folders only, so an
interrupted save never pushes a complete checkpoint out; it removes the interrupted folders first.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from typing import Any, Iterable, Iterator

from hf_longctx.training.base.faults import comm_guard
from hf_longctx.training.base.saving import DCP_DIR, SCHEDULER_NAME

MARK_FILE = "hf_longctx_checkpoint.json"
TRAINER_STATE = "trainer_state.json"  # the Trainer's own file name
DCP_METADATA = ".metadata"  # torch distributed checkpoint writes it last, after every rank's shards


def checkpoint_folders(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every `checkpoint-N` directory under `output_dir`, oldest step first
    (the names `transformers.trainer_utils.get_last_checkpoint` considers)."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    if not os.path.isdir(output_dir):
        return []
    pattern = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
    found = [(int(m.group(1)), os.path.join(output_dir, name)) for name in os.listdir(output_dir)
             if (m := pattern.match(name)) and os.path.isdir(os.path.join(output_dir, name))]
    return sorted(found)


def missing(folder: str) -> list[str]:
    """What keeps `folder` from being a complete checkpoint; empty when it is one.

    The rule: a folder holding `MARK_FILE` is complete exactly when the mark says so (written
    after every rank's files). A folder without the mark (written by a version of this package
    that did not mark its folders) counts as complete by the Trainer's own standard -- it holds `trainer_state.json`
    (written last by the Trainer's main process) and the sharded model and optimizer
    (`hf_longctx_dcp/.metadata`, which torch distributed checkpoint writes after every rank's
    shards); nothing can tell whether another rank's RNG file was cut short there."""
    mark = _read_mark(folder)
    if mark is None:
        needed = {TRAINER_STATE: "the Trainer's state, written last",
                  os.path.join(DCP_DIR, DCP_METADATA): "every rank's model and optimizer shards"}
        return [f"no {name} ({what})" for name, what in needed.items() if not os.path.exists(os.path.join(folder, name))]
    if mark.get("complete") is True:
        return []
    step = mark.get("global_step", "?")
    gaps = [(f"{MARK_FILE} marks the save of step {step} as unfinished: a rank stopped before every rank's "
             "files were written")]
    absent = [name for name in _expected_files(mark.get("world_size"))
              if not os.path.exists(os.path.join(folder, name))]
    return gaps + ([f"missing {', '.join(absent)}"] if absent else [])


def begin(folder: str, *, is_main: bool, step: int, world_size: int) -> None:
    """Before any rank writes into `folder` (a collective): the folder is marked as being written,
    also where it already holds a checkpoint of the same step that is about to be overwritten."""
    if is_main:
        os.makedirs(folder, exist_ok=True)
        _write_mark(folder, {"complete": False, "global_step": step, "world_size": world_size})
    _barrier(step)


def finish(folder: str, *, is_main: bool, step: int, world_size: int) -> None:
    """After this rank wrote all its files into `folder` (a collective): once every rank got here,
    the main process marks the folder complete."""
    _barrier(step)
    if is_main:
        _write_mark(folder, {"complete": True, "global_step": step, "world_size": world_size})


@contextlib.contextmanager
def trainer_rotation_off(args: Any) -> Iterator[None]:
    """The Trainer's `_save_checkpoint` rotates before the folder is marked complete, counting every
    `checkpoint-*` directory: inside this block it sees no `save_total_limit`; `rotate` runs after."""
    limit = args.save_total_limit
    args.save_total_limit = None
    try:
        yield
    finally:
        args.save_total_limit = limit


@contextlib.contextmanager
def trainer_push_off(args: Any) -> Iterator[bool]:
    """The Trainer's `_save_checkpoint` pushes to the Hub before the folder is marked complete and
    from a folder without a consolidated model: inside this block it sees `push_to_hub=False`;
    yields whether the arguments asked for the push (the caller pushes after the marker)."""
    push = bool(args.push_to_hub)
    args.push_to_hub = False
    try:
        yield push
    finally:
        args.push_to_hub = push


def rotate(run_dir: str, limit: int | None, protected: Iterable[str | None]) -> list[str]:
    """Under `save_total_limit=limit` (None or <= 0: nothing is removed, as in the Trainer): keep
    the `limit` newest complete checkpoints by step, never removing one of `protected` (the
    folder just written, the best model's); every incomplete folder not protected is removed
    first and counts toward nothing. Returns the removed paths. Main process only."""
    if limit is None or limit <= 0:
        return []
    keep = {os.path.normpath(p) for p in protected if p}
    folders = [(path, not missing(path)) for _, path in checkpoint_folders(run_dir)]
    removed = [path for path, complete in folders if not complete and os.path.normpath(path) not in keep]
    if removed:
        warnings.warn(f"save_total_limit={limit}: removing {', '.join(map(repr, removed))}: incomplete checkpoint "
                      "folder(s), e.g. a save that did not finish on every rank (they cannot be resumed)", stacklevel=2)
    complete = [path for path, ok in folders if ok]
    left = len(complete)
    target = max(limit, sum(os.path.normpath(p) in keep for p in complete))
    for path in complete:  # oldest step first
        if left <= target:
            break
        if os.path.normpath(path) not in keep:
            removed.append(path)
            left -= 1
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _expected_files(world_size: int | None) -> list[str]:
    """The files a complete checkpoint of `world_size` ranks holds whatever the trainer (the
    Trainer names one RNG file per process, or one file in a single process; None: unknown)."""
    if world_size is None:
        rng = []
    else:
        rng = ["rng_state.pth"] if world_size <= 1 else [f"rng_state_{r}.pth" for r in range(world_size)]
    return [os.path.join(DCP_DIR, DCP_METADATA), SCHEDULER_NAME, *rng, TRAINER_STATE]


def _read_mark(folder: str) -> dict | None:
    path = os.path.join(folder, MARK_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            mark = json.load(f)
    except (OSError, ValueError):
        return {"complete": False}  # written atomically, so unreadable means damaged: not complete
    return mark if isinstance(mark, dict) else {"complete": False}


def _write_mark(folder: str, mark: dict) -> None:
    """Atomically: a reader sees the old mark or the new one, never a partial file."""
    tmp = os.path.join(folder, f".{MARK_FILE}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(mark, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, MARK_FILE))


def _barrier(step: int) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        with comm_guard(step):  # a rank that died while saving: RankFailure on the others, within the timeout
            dist.barrier()
