"""GRPOConfig fields for the SP GRPO step (training/refusals/grpo.py): every field of the installed
TRL is classified, refusals name the value and the way forward, and the objective / sampling kwargs
come from the config."""

from __future__ import annotations

import dataclasses

import pytest

from hf_longctx.errors import NotSupported
from hf_longctx.training.grpo.generate import generation_kwargs
from hf_longctx.training.refusals.grpo import GRPO_CONFIG, check_grpo_config, refused_grpo_fields
from hf_longctx.training.grpo.loss import GRPOObjective


def _config(tmp_path, **kw):
    from trl import GRPOConfig

    return GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, **kw)


def test_every_grpo_config_field_is_classified():
    from transformers import TrainingArguments
    from trl import GRPOConfig

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    own = {f.name for f in dataclasses.fields(GRPOConfig)} - base
    assert sorted(own - set(GRPO_CONFIG)) == [], "GRPOConfig fields missing from GRPO_CONFIG"
    assert sorted(set(GRPO_CONFIG) - own) == [], "GRPO_CONFIG names fields GRPOConfig no longer has"


def test_defaults_pass_and_objective_follows_the_config(tmp_path):
    args = _config(tmp_path, loss_type="dr_grpo", beta=0.1, epsilon=0.3, epsilon_high=0.4, temperature=0.8,
                   max_completion_length=64, top_p=0.9)
    assert refused_grpo_fields(args) == []
    obj = GRPOObjective.from_config(args)
    assert (obj.loss_type, obj.beta, obj.epsilon_low, obj.epsilon_high, obj.temperature, obj.max_completion_length) == (
        "dr_grpo", 0.1, 0.3, 0.4, 0.8, 64)
    assert obj.use_bias_correction_kl is True
    kw = generation_kwargs(args)
    assert kw["do_sample"] and kw["top_p"] == 0.9 and kw["temperature"] == 0.8


@pytest.mark.parametrize("field,value", [("loss_type", "bnpo"), ("loss_type", "cispo"), ("importance_sampling_level", "sequence"),
                                         ("top_entropy_quantile", 0.5), ("entropy_coef", 0.01), ("sync_ref_model", True)])
def test_refusals_name_value_and_way_forward(tmp_path, field, value):
    args = _config(tmp_path, **{field: value})
    with pytest.raises(NotSupported, match=f"{field}={value!r}") as err:
        GRPOObjective.from_config(args)
    assert "do instead" in str(err.value).lower()


def test_unclassified_field_is_refused_when_set(tmp_path, monkeypatch):
    args = _config(tmp_path, epsilon_high=0.5)
    monkeypatch.delitem(GRPO_CONFIG, "epsilon_high")
    with pytest.raises(NotSupported, match="epsilon_high=0.5: not classified"):
        check_grpo_config(args)


def test_vllm_refused_without_importing_vllm(tmp_path):
    import sys

    args = _config(tmp_path)
    object.__setattr__(args, "use_vllm", True)  # GRPOConfig's own check would need vllm installed
    with pytest.raises(NotSupported, match="use_vllm=True"):
        check_grpo_config(args)
    assert "vllm" not in sys.modules


def test_trainer_checks_name_the_value_before_any_collective(tmp_path):
    """LongGRPOTrainer's own checks (mesh, max_tokens, the config's type, every refused value
    at once), run before TRL's __init__."""
    from hf_longctx import init_sequence_parallel
    from hf_longctx.training.refusals.grpo import check_grpo_trainer

    mesh = init_sequence_parallel()
    args = _config(tmp_path, max_completion_length=16)
    assert check_grpo_trainer(mesh, None, {"args": args}) is args
    assert check_grpo_trainer(mesh, 17, {"args": args}) is args
    with pytest.raises(TypeError, match="mesh must be an SPMesh"):
        check_grpo_trainer("mesh", None, {"args": args})
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match=f"max_tokens must be a positive int.*got {bad!r}"):
            check_grpo_trainer(mesh, bad, {"args": args})
    with pytest.raises(TypeError, match="needs args=GRPOConfig"):
        check_grpo_trainer(mesh, None, {"args": None})
    with pytest.raises(NotSupported, match=r"num_iterations=2(.|\n)*max_tokens=16 < max_completion_length=16 \+ 1"):
        check_grpo_trainer(mesh, 16, {"args": _config(tmp_path, max_completion_length=16, num_iterations=2)})


def test_a_prebuilt_optimizer_is_refused(tmp_path):
    """optimizers=(opt, sched) would step the tensors fsdp_plan replaces: refused as for the SFT
    trainer, with the way forward; (None, None), TRL's default, passes."""
    import torch

    from hf_longctx import init_sequence_parallel
    from hf_longctx.training.refusals.grpo import check_grpo_trainer

    mesh, args = init_sequence_parallel(), _config(tmp_path, max_completion_length=16)
    assert check_grpo_trainer(mesh, None, {"args": args, "optimizers": (None, None)}) is args
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(NotSupported, match=r"optimizers(.|\n)*optimizer_cls_and_kwargs"):
        check_grpo_trainer(mesh, None, {"args": args, "optimizers": (opt, None)})
