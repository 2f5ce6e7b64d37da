"""Shared recipe flags a recipe does not honour are refused, never dropped (recipes/common.refuse_flags):
recipes/grpo.py (LongGRPOTrainer: no memory preset, no trainer memory options, no resume) and
recipes/dpo.py (LongDPOTrainer: no memory preset; the trainer options pass through)."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _recipes():
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    try:
        import common
        import dpo
        import grpo
    finally:
        sys.path.pop(0)
    return common, grpo, dpo


@pytest.mark.parametrize("flags", [["--param-offload"], ["--sync-each-microbatch"], ["--memory", "balanced"]])
def test_grpo_recipe_refuses_trainer_flags(flags, capsys):
    _, grpo, _ = _recipes()
    with pytest.raises(SystemExit):
        grpo.parse_args(flags)
    assert f"{flags[0]} is not supported by this recipe; do instead:" in capsys.readouterr().err
    assert grpo.parse_args([]).param_offload is False  # the defaults parse


def test_grpo_recipe_resume_needs_checkpoints(capsys):
    """--resume continues from --save-every checkpoints (LongGRPOTrainer saves sharded ones); alone it
    is an error naming both, never a run that silently starts over."""
    _, grpo, _ = _recipes()
    with pytest.raises(SystemExit):
        grpo.parse_args(["--resume"])
    assert "--resume needs checkpoints" in capsys.readouterr().err
    args = grpo.parse_args(["--resume", "--save-every", "2"])
    assert args.resume and args.save_every == 2


def test_dpo_recipe_flags(capsys):
    """--memory is refused (its chunked loss drops the logits); the trainer options parse and pass
    through; --resume without checkpoints (--save-every) is an error naming both."""
    _, _, dpo = _recipes()
    with pytest.raises(SystemExit):
        dpo.parse_args(["--memory", "max"])
    assert "--memory is not supported by this recipe; do instead:" in capsys.readouterr().err
    args = dpo.parse_args(["--param-offload", "--sync-each-microbatch", "--resume", "--save-every", "2"])
    assert args.param_offload and args.sync_each_microbatch and args.resume and args.save_every == 2
    with pytest.raises(SystemExit):
        dpo.parse_args(["--resume"])
    assert "--resume needs checkpoints" in capsys.readouterr().err


def test_refuse_flags_only_refuses_set_flags(capsys):
    common, _, _ = _recipes()
    p = argparse.ArgumentParser()
    common.add_common_args(p)
    common.refuse_flags(p, p.parse_args([]), {"param_offload": "x"})  # default: fine
    with pytest.raises(SystemExit):
        common.refuse_flags(p, p.parse_args(["--tokenizer", "t"]), {"tokenizer": "pass token ids"})
    assert "--tokenizer is not supported by this recipe; do instead: pass token ids" in capsys.readouterr().err
