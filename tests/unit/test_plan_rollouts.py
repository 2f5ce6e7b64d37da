"""`hf-longctx plan --task grpo|rloo` and the rollouts on the training GPUs (`--rollout-tokens`).

`LongGRPOTrainer` and `LongRLOOTrainer` generate every rollout on the training GPUs (TRL's vLLM
modes are refused), so the planner charges that phase always and refuses `--rollout-tokens 0`
(or less), naming the trainer and the value to give instead; `suggest()` likewise.
"""

from __future__ import annotations

import os

import pytest

from hf_longctx.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "tests", "data", "llama-3.1-8b-config.json")
PLAN = ["plan", "--model", CONFIG, "--gpus", "8", "--gpu-memory", "80GiB", "--host-memory", "2048GiB", "--top", "1"]


@pytest.mark.parametrize("task,trainer", [("grpo", "LongGRPOTrainer"), ("rloo", "LongRLOOTrainer")])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_rollouts_elsewhere_are_refused_for_the_rollout_trainers(task, trainer, value, capsys):
    assert main([*PLAN, "--seq-len", "65536", "--task", task, "--rollout-tokens", value]) == 2
    err = capsys.readouterr().err
    for said in (f"--rollout-tokens {value}", f"{trainer} (--task {task}) generates its rollouts on the training GPUs",
                 "use_vllm", "per_device_train_batch_size", "leave --rollout-tokens out (default: --seq-len, 65536)"):
        assert said in err, (said, err)


def test_rollout_tokens_for_other_tasks_are_refused_by_value(capsys):
    assert main([*PLAN, "--seq-len", "65536", "--task", "sft", "--rollout-tokens", "5"]) == 2
    err = capsys.readouterr().err
    assert "--rollout-tokens 5 applies to --task grpo or rloo, not --task sft" in err and "drop it" in err, err


@pytest.mark.parametrize("task,trainer", [("grpo", "LongGRPOTrainer"), ("rloo", "LongRLOOTrainer")])
def test_suggest_charges_the_rollouts_and_refuses_none(task, trainer):
    """`suggest()`, the planner's Python twin: the rollouts charged by default (seq_len per GPU), as
    the CLI charges them; 0 refused, naming the trainer."""
    from hf_longctx.capacity.cluster import Cluster
    from hf_longctx.capacity.search import rank_settings, suggest
    from hf_longctx.cli.inputs import load_config

    config, cluster = load_config(CONFIG), Cluster(gpus=8, gpu_memory=80 * 2**30, host_memory=2048 * 2**30)
    best = suggest(config, cluster, 131072, task=task)
    assert best.candidate.memory.generation > 0, best.candidate.memory
    given = suggest(config, cluster, 131072, task=task, rollout_tokens=131072)
    assert best.candidate.setting == given.candidate.setting
    with pytest.raises(ValueError, match=f"rollout_tokens=0: {trainer} generates its rollouts on the training GPUs"):
        suggest(config, cluster, 131072, task=task, rollout_tokens=0)
    with pytest.raises(ValueError, match="rollout_tokens=-1"):
        rank_settings(config, cluster, 131072, task=task, rollout_tokens=-1)
