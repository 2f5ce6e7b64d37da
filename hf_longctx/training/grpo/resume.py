"""What makes `LongGRPOTrainer`'s and `LongRLOOTrainer`'s `checkpoint-N/` resume exactly: the sharded policy and optimizer
through `base/saving.py` (no second format) and TRL's sampler continuing in the right epoch.

Where it sits: called by `SPRolloutTrainer`'s checkpoint hooks (`_save_own_state`,
`_check_own_state`, `_get_train_sampler`) and its `RolloutResumeCallback` (the Trainer's
`on_train_begin` event, after it restored its state). A checkpoint
holds every rank's FSDP2 shards of policy and optimizer, the scheduler and the Trainer's own
files (state, per-rank RNG restored before the resumed step's generation). Not in it: the
frozen reference (rebuilt from the policy's path; `REFERENCE_FILE` records it and a resume
against another is refused), and no generation buffer (both knobs are 1).
`ResumableRepeatSampler` draws the trained epochs' permutations first, because TRL's
`RepeatSampler` has one generator and no `set_epoch`."""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

import torch
from transformers import TrainerCallback, TrainerState
from trl.trainer.utils import RepeatSampler


REFERENCE_FILE = "hf_longctx_grpo_reference.json"


class ResumableRepeatSampler(RepeatSampler):
    """TRL's `RepeatSampler` whose first iteration can start at epoch `epochs_done` (set on resume):
    the generator first draws the permutations of the epochs already trained, so epoch e's order
    equals the uninterrupted run's (its e-th `randperm` of the seeded generator)."""

    epochs_done = 0

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            for _ in range(self.epochs_done):
                torch.randperm(self.num_samples, generator=self.generator)  # the orders of the epochs trained before
        self.epochs_done = 0  # later epochs continue from the generator as it is
        return super().__iter__()


def resumable_sampler(sampler: RepeatSampler) -> ResumableRepeatSampler:
    """The same sampler (arguments and generator), resumable."""
    sampler.__class__ = ResumableRepeatSampler
    return sampler  # type: ignore[return-value]


def skip_trained_epochs(sampler: Any, epochs_trained: int) -> None:
    """After the Trainer restored its state: the train sampler starts at epoch `epochs_trained`."""
    if epochs_trained and isinstance(sampler, ResumableRepeatSampler):
        sampler.epochs_done = epochs_trained


class RolloutResumeCallback(TrainerCallback):
    """At `on_train_begin` (the Trainer restored its state from the checkpoint, no step has run):
    TRL's sampler starts at the epoch the checkpoint reached and TRL's count of `training_step`
    calls (`_step`, one per optimizer step here) at its global step. `int(state.epoch)` is the
    epochs completed (TrainerState's convention), the Trainer's `global_step //
    num_update_steps_per_epoch` without its arithmetic."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: TrainerState, control: Any, **kwargs: Any) -> None:
        skip_trained_epochs(self.trainer.repeat_sampler, int(state.epoch or 0))
        self.trainer.set_trained_steps(state.global_step)


def save_reference_source(output_dir: str, ref_model: Any, *, is_main: bool) -> None:
    """Beside the policy's shards (`base/saving.py`): where the frozen reference comes from (beta > 0)."""
    if is_main:
        with open(os.path.join(output_dir, REFERENCE_FILE), "w") as f:
            json.dump({"reference": _reference_source(ref_model)}, f)


def check_reference_source(checkpoint: str, ref_model: Any) -> None:
    """Before the policy's shards are read (a collective), on every rank alike: the checkpoint
    was written by a LongGRPOTrainer / LongRLOOTrainer whose reference came from where this one's
    does."""
    path = os.path.join(checkpoint, REFERENCE_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{checkpoint} has no {REFERENCE_FILE}: it was not written by a LongGRPOTrainer or "
                         "LongRLOOTrainer (or saving crashed); resume from a complete checkpoint of the same run")
    with open(path) as f:
        saved = json.load(f)["reference"]
    if saved != _reference_source(ref_model):
        raise ValueError(f"{checkpoint} was trained against the reference {saved!r}, this trainer's is "
                         f"{_reference_source(ref_model)!r} (TRL loads it from the policy's config._name_or_path; it "
                         "is not in the checkpoint); do instead: load the policy from the path the first run used")


def _reference_source(ref: Any) -> str | None:
    """Where TRL loaded the frozen reference from (None: beta = 0, no reference)."""
    return None if ref is None else str(getattr(ref.config, "_name_or_path", ""))
