"""Which `checkpoint-N/` folders count (training/base/saved_folders.py) and which one a resume reads
(training/base/resume_choice.py), on folders laid out by hand: the completion mark, the rule for
folders written without one, rotation under save_total_limit, and the refusals' fixes. The
trainers' real saves, a rank killed inside one and the resume after it:
tests/distributed/test_interrupted_save.py."""

from __future__ import annotations

import json
import os
import warnings
from types import SimpleNamespace

import pytest

from hf_longctx.errors import NotSupported
from hf_longctx.training.base import saved_folders
from hf_longctx.training.base.resume_choice import resolve_resume


def _files(folder, *names):
    for name in names:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")


def _complete(out, step):
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    saved_folders.begin(str(folder), is_main=True, step=step, world_size=2)
    _files(folder, "hf_longctx_dcp/.metadata", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth",
           "trainer_state.json")
    saved_folders.finish(str(folder), is_main=True, step=step, world_size=2)
    return str(folder)


def _interrupted(out, step, *names):
    """A save that a rank did not finish: marked as being written, holding `names` only."""
    folder = out / f"checkpoint-{step}"
    saved_folders.begin(str(folder), is_main=True, step=step, world_size=2)
    _files(folder, *names)
    return str(folder)


def _legacy(out, step, *names):
    """A folder written without the mark."""
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    _files(folder, *names)
    return str(folder)


def test_the_mark_decides_and_names_what_an_interrupted_save_lacks(tmp_path):
    assert saved_folders.missing(_complete(tmp_path, 2)) == []
    # rank 0 wrote trainer_state.json; rank 1 died before its RNG file (the Trainer's own
    # standard would call this complete)
    gaps = saved_folders.missing(_interrupted(tmp_path, 4, "hf_longctx_dcp/.metadata", "scheduler.pt",
                                           "rng_state_0.pth", "trainer_state.json"))
    assert "marks the save of step 4 as unfinished" in gaps[0] and gaps[1:] == ["missing rng_state_1.pth"], gaps
    # every file there, the final barrier not passed: still incomplete (a file may be cut short)
    full = _interrupted(tmp_path, 6, "hf_longctx_dcp/.metadata", "scheduler.pt", "rng_state_0.pth",
                        "rng_state_1.pth", "trainer_state.json")
    assert len(saved_folders.missing(full)) == 1
    saved_folders.finish(full, is_main=True, step=6, world_size=2)
    assert saved_folders.missing(full) == [] and not [n for n in os.listdir(full) if n.endswith(".tmp")]
    saved_folders.begin(full, is_main=True, step=6, world_size=2)  # overwritten by a later save: incomplete again
    assert saved_folders.missing(full)
    (tmp_path / "checkpoint-6" / saved_folders.MARK_FILE).write_text("{trunc")
    assert saved_folders.missing(full), "a damaged mark is not a complete one"


def test_a_folder_without_the_mark_counts_by_the_trainers_standard(tmp_path):
    assert saved_folders.missing(_legacy(tmp_path, 2, "trainer_state.json", "hf_longctx_dcp/.metadata")) == []
    gaps = saved_folders.missing(_legacy(tmp_path, 4, "trainer_state.json", "hf_longctx_dcp/__0_0.distcp"))
    assert gaps == ["no hf_longctx_dcp/.metadata (every rank's model and optimizer shards)"], gaps
    gaps = saved_folders.missing(_legacy(tmp_path, 6, "hf_longctx_dcp/.metadata"))
    assert gaps == ["no trainer_state.json (the Trainer's state, written last)"], gaps


def _left(out):
    return sorted(d for d in os.listdir(out) if d.startswith("checkpoint-"))


@pytest.mark.parametrize("limit, left", [(1, ["checkpoint-6"]), (2, ["checkpoint-2", "checkpoint-6"]),
                                         (3, ["checkpoint-2", "checkpoint-6"]),
                                         (None, ["checkpoint-2", "checkpoint-4", "checkpoint-6"])])
def test_rotation_counts_complete_checkpoints_only(tmp_path, limit, left):
    _complete(tmp_path, 2)
    _interrupted(tmp_path, 4, "trainer_state.json", "hf_longctx_dcp/.metadata")
    newest = _complete(tmp_path, 6)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        saved_folders.rotate(str(tmp_path), limit, (newest, None))
    assert _left(tmp_path) == left
    assert bool(said) == (limit is not None) and (not said or "'" + str(tmp_path / "checkpoint-4") in str(said[0].message))


def test_rotation_keeps_the_new_and_the_best_checkpoint(tmp_path):
    best = _complete(tmp_path, 2)
    _complete(tmp_path, 4)
    _legacy(tmp_path, 5, "trainer_state.json", "hf_longctx_dcp/.metadata")  # complete without the mark
    newest = _complete(tmp_path, 6)
    assert saved_folders.rotate(str(tmp_path), 1, (newest, best)) == [str(tmp_path / "checkpoint-4"),
                                                                    str(tmp_path / "checkpoint-5")]
    assert _left(tmp_path) == ["checkpoint-2", "checkpoint-6"]


def test_the_trainers_own_rotation_is_off_inside_the_save_only():
    args = SimpleNamespace(save_total_limit=2)
    with pytest.raises(RuntimeError):
        with saved_folders.trainer_rotation_off(args):
            assert args.save_total_limit is None
            raise RuntimeError("a failed save")
    assert args.save_total_limit == 2


def test_true_takes_the_newest_complete_checkpoint_and_says_what_it_skipped(tmp_path):
    two = _complete(tmp_path, 2)
    _interrupted(tmp_path, 4, "hf_longctx_dcp/.metadata")
    _complete(tmp_path, 3)
    _interrupted(tmp_path, 10)  # checkpoint-10 sorts by step, not by name
    with pytest.warns(UserWarning) as said:
        assert resolve_resume(True, str(tmp_path), announce=True) == str(tmp_path / "checkpoint-3")
    text = str(said[0].message)
    assert "skipping 'checkpoint-4' (" in text and "'checkpoint-10' (" in text and "missing scheduler.pt" in text
    assert text.endswith(f"resuming from '{tmp_path / 'checkpoint-3'}', the newest complete checkpoint"), text
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the other ranks say nothing
        assert resolve_resume(True, str(tmp_path), announce=False) == str(tmp_path / "checkpoint-3")
        assert resolve_resume(two, str(tmp_path)) == two  # an explicit complete path, as given


def test_true_with_no_complete_checkpoint_names_each_folder_and_never_offers_true(tmp_path):
    _interrupted(tmp_path, 2, "trainer_state.json")
    _legacy(tmp_path, 4)
    with pytest.raises(NotSupported) as info:
        resolve_resume(True, str(tmp_path))
    what, instead = info.value.what, info.value.instead
    assert f"no checkpoint under output_dir '{tmp_path}' is complete" in what
    assert "'checkpoint-2' (hf_longctx_checkpoint.json marks the save of step 2 as unfinished" in what, what
    assert "'checkpoint-4' (no trainer_state.json" in what, what
    assert "resume_from_checkpoint=None" in instead and "True" not in instead, instead


def test_an_explicit_incomplete_checkpoint_is_refused_with_the_newest_complete_one(tmp_path):
    _complete(tmp_path, 2)
    _complete(tmp_path, 4)
    partial = _interrupted(tmp_path, 6, "trainer_state.json")
    with pytest.raises(NotSupported) as info:
        resolve_resume(partial, str(tmp_path))
    what, instead = info.value.what, info.value.instead
    assert f"resume_from_checkpoint='{partial}' is not a complete checkpoint: " in what, what
    assert "missing hf_longctx_dcp/.metadata, scheduler.pt, rng_state_0.pth, rng_state_1.pth" in what, what
    assert "holds checkpoint-2, checkpoint-4, checkpoint-6 (incomplete)" in what, what
    assert instead.startswith(f"resume_from_checkpoint='{tmp_path / 'checkpoint-4'}', the newest complete"), instead
    with pytest.raises(NotSupported) as info:  # a path that is not there: the same fix
        resolve_resume(str(tmp_path / "checkpoint-8"), str(tmp_path))
    assert "does not exist" in info.value.what and str(tmp_path / "checkpoint-4") in info.value.instead


def test_an_explicit_path_with_nothing_complete_suggests_starting_fresh(tmp_path):
    partial = _interrupted(tmp_path, 2)
    with pytest.raises(NotSupported) as info:
        resolve_resume(partial, str(tmp_path))
    assert "True" not in info.value.instead and "resume_from_checkpoint=None" in info.value.instead
    with pytest.raises(NotSupported) as info:
        resolve_resume(True, str(tmp_path / "nowhere"))
    assert "holds no checkpoint-N directory" in info.value.what and "save_steps=N" in info.value.instead
    mark = json.loads((tmp_path / "checkpoint-2" / saved_folders.MARK_FILE).read_text())
    assert mark == {"complete": False, "global_step": 2, "world_size": 2}


@pytest.mark.parametrize("trainer", ["LongContextTrainer", "SFT mixin", "LongDPOTrainer", "LongGRPOTrainer",
                                     "LongRLOOTrainer"])
def test_every_trainer_saves_and_resumes_through_the_shared_base(trainer):
    """The mark, the rotation and the resume choice live in `SPTrainerBase`: no trainer (nor the
    TRL class under it, whose `_save_checkpoint` adds a model card) may come first."""
    import hf_longctx
    from hf_longctx.training.base.trainer import SPTrainerBase

    if trainer == "SFT mixin":
        trl = pytest.importorskip("trl")

        class LongSFT(hf_longctx.LongContextTrainerMixin, trl.SFTTrainer):
            pass

        cls = LongSFT
    else:
        if trainer != "LongContextTrainer":
            pytest.importorskip("trl")
        cls = getattr(hf_longctx, trainer)
    for hook in ("train", "_save_checkpoint"):
        owner = next(c for c in cls.__mro__ if hook in vars(c))
        assert owner is SPTrainerBase, f"{cls.__name__}.{hook} comes from {owner.__name__}"
