"""Which checkpoint `train(resume_from_checkpoint=...)` reads, checked before the Trainer reads anything.

Where it sits: first thing in `SPTrainerBase.train` (every trainer of this package), on every
rank alike and before any collective. Guarantee: the value reaching the Trainer names a
COMPLETE `checkpoint-N` directory (`base/saved_folders.py`: every rank's files written) or is
None / False. True takes the newest complete one, saying on the main process which newer,
incomplete folders it skipped (a save a dead rank interrupted). Anything else is refused with
`NotSupported` naming the value, what is missing, what `output_dir` holds and a fix that works:
the newest complete checkpoint, or starting fresh where there is none (the Trainer would raise
a bare FileNotFoundError or ValueError, or fail inside a collective read).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from hf_longctx.errors import NotSupported
from hf_longctx.training.base.saved_folders import checkpoint_folders, missing

FRESH = "pass resume_from_checkpoint=None to start from the model's own weights"


def resolve_resume(resume_from_checkpoint: Any, output_dir: str, *, announce: bool = True) -> Any:
    """`train(resume_from_checkpoint=...)` -> the checkpoint directory the Trainer reads (None /
    False unchanged). True: the newest complete `checkpoint-N` under `output_dir`, skipping
    newer incomplete ones with a warning when `announce` (the main process); a path: a complete
    checkpoint directory. Raises `NotSupported` otherwise, on every rank alike."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return resume_from_checkpoint
    folders = checkpoint_folders(output_dir)
    gaps = {path: missing(path) for _, path in folders}
    complete = [(step, path) for step, path in folders if not gaps[path]]
    newest = complete[-1] if complete else None
    if resume_from_checkpoint is True:
        if not folders:
            raise NotSupported(
                f"resume_from_checkpoint=True, but output_dir '{output_dir}' holds no {PREFIX_CHECKPOINT_DIR}-N "
                "directory: nothing was saved there yet (save_strategy='no', or the run saved under another output_dir)",
                f"{FRESH}; or the path of a {PREFIX_CHECKPOINT_DIR}-N directory of an earlier run; to write checkpoints, "
                "train with save_strategy='steps' and save_steps=N",
            )
        if newest is None:
            raise NotSupported(
                f"resume_from_checkpoint=True, but no checkpoint under output_dir '{output_dir}' is complete: "
                + "; ".join(_why(path, gaps[path]) for _, path in folders),
                f"{FRESH} (no save finished on every rank there: those folders cannot be resumed and may be "
                "deleted), or the path of a complete checkpoint of an earlier run",
            )
        skipped = [path for step, path in folders if gaps[path] and step > newest[0]]
        if skipped and announce:
            warnings.warn(
                "resume_from_checkpoint=True: skipping " + "; ".join(_why(path, gaps[path]) for path in skipped)
                + f"; resuming from '{newest[1]}', the newest complete checkpoint", stacklevel=3)
        return newest[1]
    path = os.fspath(resume_from_checkpoint)
    if not os.path.isdir(path):
        what = "does not exist" if not os.path.exists(path) else "is a file, not a checkpoint directory"
    else:
        here = missing(path)
        what = f"is not a complete checkpoint: {'; '.join(here)}" if here else ""
    if what:
        raise NotSupported(f"resume_from_checkpoint={path!r} {what}; {_holds(output_dir, folders, gaps)}",
                           _instead(newest))
    return path


def _why(path: str, gaps: list[str]) -> str:
    return f"'{os.path.basename(path)}' ({'; '.join(gaps)})"


def _holds(output_dir: str, folders: list[tuple[int, str]], gaps: dict[str, list[str]]) -> str:
    if not folders:
        return f"output_dir '{output_dir}' holds no checkpoint"
    names = [os.path.basename(p) + ("" if not gaps[p] else " (incomplete)") for _, p in folders]
    return f"output_dir '{output_dir}' holds {', '.join(names)}"


def _instead(newest: tuple[int, str] | None) -> str:
    """A fix that works: the newest complete checkpoint (True picks it too), or starting fresh."""
    if newest is None:
        return f"{FRESH}, or the path of a complete checkpoint-N directory written by this package's trainers"
    return (f"resume_from_checkpoint='{newest[1]}', the newest complete checkpoint under output_dir "
            f"(resume_from_checkpoint=True picks it too); or {FRESH.removeprefix('pass ')}")
