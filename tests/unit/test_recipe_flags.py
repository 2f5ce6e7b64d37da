"""Shared recipe flags a recipe does not honour are refused, never dropped (recipes/common.refuse_flags):
recipes/grpo.py and recipes/rloo.py (LongGRPOTrainer / LongRLOOTrainer take neither
sync_each_microbatch nor param_offload; --resume needs --save-every); the memory flags go to
`patch` in every post-training recipe (dpo.py, grpo.py, rloo.py), and recipes/dpo.py passes the
trainer options through."""

from __future__ import annotations

import argparse
import os

import pytest

from tests.helpers.recipe_launch import recipe_modules

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _recipes():
    common, dpo, grpo, rloo = recipe_modules("common", "dpo", "grpo", "rloo")
    return common, {"grpo": grpo, "rloo": rloo}, dpo


@pytest.mark.parametrize("recipe", ["grpo", "rloo"])
@pytest.mark.parametrize("flags,why", [(["--param-offload"], "takes no param_offload"),
                                       (["--sync-each-microbatch"], "always reduce-scatters")])
def test_rollout_recipes_refuse_trainer_flags(recipe, flags, why, capsys):
    rollouts = _recipes()[1][recipe]
    with pytest.raises(SystemExit):
        rollouts.parse_args(flags)
    err = capsys.readouterr().err
    assert f"{flags[0]} is not supported by this recipe; do instead:" in err and why in err, err
    assert rollouts.parse_args([]).param_offload is False  # the defaults parse


@pytest.mark.parametrize("recipe", ["dpo", "grpo", "rloo"])
def test_post_training_recipes_honour_the_memory_flags(recipe):
    """--memory (with --inputs-on-device), --kv-offload and --mixers reach `patch(model, mesh, ...)`
    in every post-training recipe: the trainers compute log-probs through the row-chunked LM
    head under every preset (tests/distributed/test_dpo_trainer.py, test_grpo_trainer.py,
    test_rloo_trainer.py run memory="max" with FPDT chunks)."""
    common, rollouts, dpo = _recipes()
    module = {"dpo": dpo, **rollouts}[recipe]
    for flags, want in [(["--memory", "max", "--inputs-on-device", "1"], {"memory": "max", "inputs_on_device": 1}),
                        (["--memory", "balanced"], {"memory": "balanced"}),
                        (["--fpdt-chunks", "2", "--kv-offload"], {"kv_offload": True}),
                        (["--mixers", "heads"], {"mixers": "heads"})]:
        assert common.patch_kwargs(module.parse_args(flags)) == want, flags


@pytest.mark.parametrize("recipe", ["grpo", "rloo"])
def test_rollout_recipes_resume_needs_checkpoints(recipe, capsys):
    """--resume continues from --save-every checkpoints (the rollout trainers save sharded ones); alone
    it is an error naming both, never a run that silently starts over."""
    rollouts = _recipes()[1][recipe]
    with pytest.raises(SystemExit):
        rollouts.parse_args(["--resume"])
    assert "--resume needs checkpoints" in capsys.readouterr().err
    args = rollouts.parse_args(["--resume", "--save-every", "2"])
    assert args.resume and args.save_every == 2


def test_dpo_recipe_flags(capsys):
    """The trainer options parse and pass through (`trainer_kwargs`); --resume without
    checkpoints (--save-every) is an error naming both."""
    common, _, dpo = _recipes()
    args = dpo.parse_args(["--param-offload", "--sync-each-microbatch", "--resume", "--save-every", "2"])
    assert args.param_offload and args.sync_each_microbatch and args.resume and args.save_every == 2
    assert common.trainer_kwargs(args) == {"sync_each_microbatch": True, "param_offload": True}
    assert dpo.dpo_trainer_kwargs(args) == {"sync_each_microbatch": True, "param_offload": True}
    with pytest.raises(SystemExit):
        dpo.parse_args(["--resume"])
    assert "--resume needs checkpoints" in capsys.readouterr().err


def test_dpo_recipe_verify_ref_logps(capsys):
    """--verify-ref-logps N reaches LongDPOTrainer(verify_ref_logps=N); without
    --precompute-ref-log-probs (no stored columns are read) or below 0 it is an error naming the
    flag, never dropped."""
    _, _, dpo = _recipes()
    args = dpo.parse_args(["--precompute-ref-log-probs", "--verify-ref-logps", "8"])
    assert dpo.dpo_trainer_kwargs(args) == {"sync_each_microbatch": False, "param_offload": False, "verify_ref_logps": 8}
    assert "verify_ref_logps" not in dpo.dpo_trainer_kwargs(dpo.parse_args(["--precompute-ref-log-probs"]))
    for flags, needle in ((["--verify-ref-logps", "8"], "read only with --precompute-ref-log-probs"),
                          (["--precompute-ref-log-probs", "--verify-ref-logps", "-1"], "how many pairs")):
        with pytest.raises(SystemExit):
            dpo.parse_args(flags)
        err = capsys.readouterr().err
        assert "--verify-ref-logps" in err and needle in err, err


def test_refuse_flags_only_refuses_set_flags(capsys):
    common, _, _ = _recipes()
    p = argparse.ArgumentParser()
    common.add_common_args(p)
    common.refuse_flags(p, p.parse_args([]), {"param_offload": "x"})  # default: fine
    with pytest.raises(SystemExit):
        common.refuse_flags(p, p.parse_args(["--tokenizer", "t"]), {"tokenizer": "pass token ids"})
    assert "--tokenizer is not supported by this recipe; do instead: pass token ids" in capsys.readouterr().err


def test_mixed_precision_follows_the_device_by_default(monkeypatch):
    """pretrain/lora/sft default to bf16 on CUDA and fp32 on CPU (bf16 matmuls are slow there);
    an explicit flag wins either way."""
    import torch

    common, _, _ = _recipes()
    for cuda, want in ((False, "fp32"), (True, "bf16")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        p = common.add_common_args(argparse.ArgumentParser())
        assert common.check_common_args(p, p.parse_args([])).mixed_precision == want
        assert common.check_common_args(p, p.parse_args(["--mixed-precision", "fp32"])).mixed_precision == "fp32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (sft,) = recipe_modules("sft")
    required = ["--model", "m", "--dataset", "json", "--steps", "1", "--tokens-per-step", "8", "--max-tokens", "8",
                "--output-dir", "out"]
    assert sft.parse_args(required).mixed_precision == "fp32"  # sft.py on a CPU machine


def test_every_memory_preset_is_listed_where_the_flag_is_documented():
    from hf_longctx.config import MEMORY_PRESETS

    common, _, _ = _recipes()
    flag = "--memory " + "\\|".join(MEMORY_PRESETS)  # as the markdown table escapes the bars
    with open(os.path.join(ROOT, "recipes", "README.md")) as f:
        assert flag in f.read()
    assert "--memory " + "|".join(MEMORY_PRESETS) in common.__doc__
    p = common.add_common_args(argparse.ArgumentParser())
    assert all(preset in p.format_help() for preset in MEMORY_PRESETS if preset != "off")


def test_vlm_recipe_tokenizer_needs_a_model(capsys):
    """recipes/vlm_sft.py honours --tokenizer as the processor of --model and --resume; --tokenizer
    without --model (the recipe builds its own model and processor) is an error, not ignored."""
    (vlm_sft,) = recipe_modules("vlm_sft")
    with pytest.raises(SystemExit):
        vlm_sft.parse_args(["--tokenizer", "some/processor"])
    assert "--tokenizer names the processor of --model" in capsys.readouterr().err
    args = vlm_sft.parse_args(["--model", "m", "--tokenizer", "p", "--resume"])
    assert args.tokenizer == "p" and args.resume


def test_inputs_on_device_goes_to_patch_with_a_checkpointing_preset_only(capsys):
    common, _, _ = _recipes()
    p = common.add_common_args(argparse.ArgumentParser())
    args = common.check_common_args(p, p.parse_args(["--memory", "max", "--inputs-on-device", "3"]))
    assert common.patch_kwargs(args) == {"memory": "max", "inputs_on_device": 3}
    assert common.patch_kwargs(common.check_common_args(p, p.parse_args(["--memory", "max"]))) == {"memory": "max"}
    for flags in (["--inputs-on-device", "2"], ["--memory", "balanced", "--inputs-on-device", "2"],
                  ["--memory", "max", "--inputs-on-device", "-1"]):
        with pytest.raises(SystemExit):
            common.check_common_args(p, p.parse_args(flags))
    err = capsys.readouterr().err
    assert "--inputs-on-device 2 keeps checkpointed layer inputs on the GPU: it needs --memory high or max" in err
    assert "--inputs-on-device must be >= 0, got -1" in err
