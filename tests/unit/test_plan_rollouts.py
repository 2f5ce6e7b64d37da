"""`hf-longctx plan --task grpo|rloo` and the rollouts on the training GPUs (`--rollout-tokens`).

`LongGRPOTrainer` and `LongRLOOTrainer` generate every rollout on the training GPUs (TRL's vLLM
modes are refused), so the planner charges that phase always and refuses `--rollout-tokens 0`
(or less), naming the trainer and the value to give instead. Where the rollouts set the GPU peak,
the answer names `--rollout-tokens`: what it counts, the value assumed when it was not given, the
training step's own peak, and the most rollout tokens that fit; that figure is checked by
planning with it (it fits) and with a tenth more (it does not).
"""

from __future__ import annotations

import os
import re

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


def test_binding_rollouts_name_the_flag_and_what_fits(capsys):
    """rloo at 1M tokens: the training step fits, generating 1M tokens per GPU does not."""
    assert main([*PLAN, "--seq-len", "1048576", "--task", "rloo"]) == 1
    err = capsys.readouterr().err
    for said in ("the rollouts set it", "generating 1048576 tokens per GPU", "--rollout-tokens",
                 "prompt + completion tokens each GPU generates per step", "not given: --seq-len, 1048576, assumed",
                 "(the training step alone "):
        assert said in err, (said, err)
    assert "more --gpus" not in err, err  # each GPU generates its own rows with the whole model: more GPUs do not help
    fit = int(re.search(r"At most ([\d,]+) rollout tokens per GPU fit at this setting: give --rollout-tokens", err)
              .group(1).replace(",", ""))
    assert 0 < fit < 1048576, err
    assert main([*PLAN, "--seq-len", "1048576", "--task", "rloo", "--rollout-tokens", str(fit)]) == 0
    out = capsys.readouterr().out
    assert "--rollout-tokens " + str(fit) in out, out[-2000:]
    assert main([*PLAN, "--seq-len", "1048576", "--task", "rloo", "--rollout-tokens", str(fit * 11 // 10)]) == 1
    capsys.readouterr()


def test_the_reported_plan_names_the_flag_with_the_host_limit(capsys):
    """rloo at 1M tokens with 256 GiB of host per node and no --rollout-tokens: both limits bind,
    and the answer names the flag, its assumed value, and no parameter offload to switch off."""
    assert main([*PLAN[:-4], "--host-memory", "256GiB", "--top", "1", "--seq-len", "1048576", "--task", "rloo"]) == 1
    err = capsys.readouterr().err
    for said in ("HOST memory binds", "LongRLOOTrainer offloads no parameters", "the rollouts set it",
                 "--rollout-tokens (not given: --seq-len, 1048576, assumed)", "give --rollout-tokens"):
        assert said in err, (said, err)
    assert "--param-offload no" not in err, err


def test_the_fit_line_names_the_rollouts_when_they_set_the_peak(capsys):
    assert main([*PLAN, "--seq-len", "1048576", "--task", "grpo", "--rollout-tokens", "150000"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("suggested ("))
    assert "GPU memory binds first, set by the rollouts (--rollout-tokens 150000 per GPU" in line, line
    assert "the training step alone uses" in line, line
    assert "--rollout-tokens 150000 tokens per GPU" in out and "rollouts)" in out, out  # the footer's peak names them


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
