"""RLOOConfig fields for `LongRLOOTrainer` (training/refusals/rloo.py): every field of the installed
TRL is classified, refusals name the value and the way forward, a new unclassified field is
refused when set, and the objective comes from the config."""

from __future__ import annotations

import dataclasses

import pytest

from hf_longctx.errors import NotSupported
from hf_longctx.training.refusals.rloo import RLOO_CONFIG, check_rloo_config, check_rloo_trainer, refused_rloo_fields
from hf_longctx.training.rloo.loss import RLOOObjective


def _config(tmp_path, **kw):
    from trl import RLOOConfig

    return RLOOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, **kw)


def test_every_rloo_config_field_is_classified():
    from transformers import TrainingArguments
    from trl import RLOOConfig

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    own = {f.name for f in dataclasses.fields(RLOOConfig)} - base
    assert sorted(own - set(RLOO_CONFIG)) == [], "RLOOConfig fields missing from RLOO_CONFIG"
    assert sorted(set(RLOO_CONFIG) - own) == [], "RLOO_CONFIG names fields RLOOConfig no longer has"
    for name, rule in RLOO_CONFIG.items():
        assert rule.kind in ("trainer", "ours", "refused"), name
        assert (rule.ok is not None and bool(rule.instead)) == (rule.kind == "refused"), name


def test_defaults_pass_and_objective_follows_the_config(tmp_path):
    args = _config(tmp_path, beta=0.1, epsilon=0.3, temperature=0.8, normalize_advantages=True,
                   reward_clip_range=(-1.0, 1.0))
    assert refused_rloo_fields(args) == []
    obj = RLOOObjective.from_config(args)
    assert (obj.beta, obj.epsilon_low, obj.epsilon_high, obj.temperature) == (0.1, 0.3, 0.3, 0.8)
    assert RLOOObjective.from_config(_config(tmp_path, epsilon_high=0.28)).epsilon_high == 0.28


@pytest.mark.parametrize("field,value", [("sync_ref_model", True), ("model_init_kwargs", {"dtype": "float32"}),
                                         ("use_transformers_continuous_batching", True)])
def test_refusals_name_value_and_way_forward(tmp_path, field, value):
    args = _config(tmp_path, **{field: value})
    with pytest.raises(NotSupported, match=f"{field}=") as err:
        RLOOObjective.from_config(args)
    assert "do instead" in str(err.value).lower()


def test_unclassified_field_is_refused_when_set(tmp_path, monkeypatch):
    args = _config(tmp_path, reward_clip_range=(0.0, 1.0))
    monkeypatch.delitem(RLOO_CONFIG, "reward_clip_range")
    with pytest.raises(NotSupported, match=r"reward_clip_range=\(0.0, 1.0\): not classified"):
        check_rloo_config(args)


def test_vllm_refused_with_the_reason_without_importing_vllm(tmp_path):
    """Server mode is refused naming what it lacks: vllm, a CUDA device and NCCL for TRL's weight push,
    and a weight walk that would stream FSDP2 shards."""
    import sys

    args = _config(tmp_path)
    object.__setattr__(args, "use_vllm", True)
    object.__setattr__(args, "vllm_mode", "server")
    with pytest.raises(NotSupported, match="use_vllm=True") as err:
        check_rloo_config(args)
    for part in ("VLLMClient", "NCCL", "CUDA", "vllm package", "DTensor shard", "use_vllm=False"):
        assert part in str(err.value), part
    assert "vllm" not in sys.modules


def test_trainer_checks_name_the_value_before_any_collective(tmp_path):
    from hf_longctx import init_sequence_parallel

    mesh = init_sequence_parallel()
    args = _config(tmp_path, max_completion_length=16)
    assert check_rloo_trainer(mesh, None, {"args": args}) is args
    with pytest.raises(TypeError, match="needs args=RLOOConfig"):
        check_rloo_trainer(mesh, None, {"args": None})
    with pytest.raises(NotSupported, match=r"LongRLOOTrainer(.|\n)*num_iterations=2(.|\n)*max_tokens=16 < "):
        check_rloo_trainer(mesh, 16, {"args": _config(tmp_path, max_completion_length=16, num_iterations=2)})
    with pytest.raises(NotSupported, match=r"peft_config"):
        check_rloo_trainer(mesh, None, {"args": args, "peft_config": object()})


def test_what_vllm_server_mode_lacks_is_what_trl_says():
    """The facts the use_vllm refusal names, read from TRL itself: its VLLMClient cannot be built
    without the vllm package and its HTTP client (it raises before any request: the loopback address is never
    contacted), and its weight walk recognises FSDP only through Accelerate's fsdp_plugin, which
    these trainers do not set (they shard with fully_shard themselves)."""
    from types import SimpleNamespace

    from trl.distributed import DistributedBackend
    from trl.import_utils import is_vllm_available

    if is_vllm_available():
        pytest.skip("vllm is installed here: the client builds; the refusal stands on the other reasons")
    from trl.generation.vllm_client import VLLMClient

    # TRL checks its HTTP client's package first, then vllm: either missing stops the build
    with pytest.raises(ImportError, match="(vLLM|requests) is not installed"):
        VLLMClient(base_url="http://127.0.0.1:9", connection_timeout=0.0)
    no_plugins = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=None))
    assert DistributedBackend(no_plugins).is_fsdp is False
