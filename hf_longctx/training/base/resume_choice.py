"""Which checkpoint `train(resume_from_checkpoint=...)` reads, checked before the Trainer reads anything.

Where it sits: first thing in `SPTrainerBase.train` (every trainer of this package), on every
rank alike and before any collective. Guarantee: the value reaching the Trainer names a
`checkpoint-N` directory holding `trainer_state.json` (or is None / False); anything else is
refused with `NotSupported` naming the value, what `output_dir` holds and the fix, where the
Trainer would raise a bare FileNotFoundError or ValueError, or fail inside a collective read.
"""

from __future__ import annotations

import os
from typing import Any


def resolve_resume(resume_from_checkpoint: Any, output_dir: str) -> Any:
    """`train(resume_from_checkpoint=...)` checked before the Trainer reads anything: True -> the
    newest `checkpoint-N` under `output_dir`; a path -> a directory holding `trainer_state.json`.
    Anything else that names no checkpoint raises `NotSupported` with the fix, on every rank
    alike, before any collective (the Trainer would raise a bare FileNotFoundError or ValueError)."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

    from hf_longctx.errors import NotSupported

    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return resume_from_checkpoint
    found = sorted(d for d in os.listdir(output_dir) if d.startswith(f"{PREFIX_CHECKPOINT_DIR}-")) if os.path.isdir(
        output_dir) else []
    fresh = "pass resume_from_checkpoint=None to start from the model's own weights"
    if resume_from_checkpoint is True:
        last = get_last_checkpoint(output_dir) if found else None
        if last is None:
            raise NotSupported(
                f"resume_from_checkpoint=True, but output_dir '{output_dir}' holds no {PREFIX_CHECKPOINT_DIR}-N "
                "directory: nothing was saved there yet (save_strategy='no', or the run saved under another output_dir)",
                f"{fresh}; or the path of a {PREFIX_CHECKPOINT_DIR}-N directory of an earlier run; to write checkpoints, "
                "train with save_strategy='steps' and save_steps=N",
            )
        resume_from_checkpoint = last
    path = os.fspath(resume_from_checkpoint)
    if not os.path.isfile(os.path.join(path, "trainer_state.json")):
        what = "does not exist" if not os.path.exists(path) else "is not a checkpoint directory (no trainer_state.json)"
        raise NotSupported(
            f"resume_from_checkpoint={path!r} {what}; output_dir '{output_dir}' holds "
            + (f"{', '.join(found)}" if found else "no checkpoint"),
            f"{fresh}, True for the newest checkpoint under output_dir, or the path of a {PREFIX_CHECKPOINT_DIR}-N "
            "directory written by this trainer",
        )
    return path
