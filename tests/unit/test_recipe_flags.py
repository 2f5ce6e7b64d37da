"""Shared recipe flags a recipe does not honour are refused, never dropped (recipes/common.refuse_flags):
the GRPO and DPO loops take the shared option set but no trainer options."""

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
        import grpo
    finally:
        sys.path.pop(0)
    return common, grpo


@pytest.mark.parametrize("flag", ["--param-offload", "--sync-each-microbatch", "--resume"])
def test_grpo_recipe_refuses_trainer_flags(flag, capsys):
    _, grpo = _recipes()
    with pytest.raises(SystemExit):
        grpo.parse_args([flag])
    assert f"{flag} is not supported by this recipe; do instead:" in capsys.readouterr().err
    assert grpo.parse_args([]).param_offload is False  # the defaults parse


def test_refuse_flags_only_refuses_set_flags(capsys):
    common, _ = _recipes()
    p = argparse.ArgumentParser()
    common.add_common_args(p)
    common.refuse_flags(p, p.parse_args([]), {"param_offload": "x"})  # default: fine
    with pytest.raises(SystemExit):
        common.refuse_flags(p, p.parse_args(["--tokenizer", "t"]), {"tokenizer": "pass token ids"})
    assert "--tokenizer is not supported by this recipe; do instead: pass token ids" in capsys.readouterr().err
