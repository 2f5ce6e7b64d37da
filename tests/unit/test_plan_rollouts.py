"""`hf-longctx plan --task grpo|rloo` and the rollouts on the training GPUs (`--rollout-tokens`).

`LongGRPOTrainer` and `LongRLOOTrainer` generate every rollout on the training GPUs (TRL's vLLM
modes are refused), so the planner charges that phase always and refuses `--rollout-tokens 0`
(or less), naming the trainer and the value to give instead. Where the rollouts set the GPU peak,
the answer names `--rollout-tokens`: what it counts, the value assumed when it was not given, the
training step's own peak, and the most rollout tokens that fit; that figure is checked by
planning with it (it fits) and with a tenth more (it does not). Both paths: sequence-parallel
rollouts (`--generation sp`, the default: counted per SP group, 1/SP of their cache per GPU) and
per rank (`--generation per-rank`: counted per GPU, the whole model gathered; the suggestion then
carries `generation='per-rank'` and the recipe flag).
"""

from __future__ import annotations

import os
import re

import pytest

from hf_longctx.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "tests", "data", "llama-3.1-8b-config.json")
PLAN = ["plan", "--model", CONFIG, "--gpus", "8", "--gpu-memory", "80GiB", "--host-memory", "2048GiB", "--top", "1"]
PER_RANK = ["--generation", "per-rank"]


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
    """rloo at 1M tokens, rollouts per rank: the training step fits, generating 1M tokens per GPU does not."""
    assert main([*PLAN, "--seq-len", "1048576", "--task", "rloo", *PER_RANK]) == 1
    err = capsys.readouterr().err
    for said in ("the rollouts set it", "generating 1048576 tokens per GPU", "--rollout-tokens",
                 "prompt + completion tokens one generation decodes per step", "not given: --seq-len, 1048576, assumed",
                 "(the training step alone "):
        assert said in err, (said, err)
    assert "more --gpus" not in err and "--generation sp does" in err, err  # per rank: more GPUs do not help
    fit = int(re.search(r"At most ([\d,]+) rollout tokens per GPU fit at this setting: give --rollout-tokens", err)
              .group(1).replace(",", ""))
    assert 0 < fit < 1048576, err
    assert main([*PLAN, "--seq-len", "1048576", "--task", "rloo", "--rollout-tokens", str(fit), *PER_RANK]) == 0
    out = capsys.readouterr().out
    assert "--rollout-tokens " + str(fit) in out and "generation='per-rank'" in out, out[-2000:]
    assert "--generation per-rank" in out, out[-2000:]  # the recipe flags keep the planned path
    assert main([*PLAN, "--seq-len", "1048576", "--task", "rloo", "--rollout-tokens", str(fit * 11 // 10), *PER_RANK]) == 1
    capsys.readouterr()


def test_the_reported_plan_names_the_flag_with_the_host_limit(capsys):
    """rloo at 1M tokens with 256 GiB of host per node and no --rollout-tokens: both limits bind,
    and the answer names the flag, its assumed value, and no parameter offload to switch off."""
    assert main([*PLAN[:-4], "--host-memory", "256GiB", "--top", "1", "--seq-len", "1048576", "--task", "rloo",
                 *PER_RANK]) == 1
    err = capsys.readouterr().err
    for said in ("HOST memory binds", "LongRLOOTrainer offloads no parameters", "the rollouts set it",
                 "--rollout-tokens (not given: --seq-len, 1048576, assumed)", "give --rollout-tokens"):
        assert said in err, (said, err)
    assert "--param-offload no" not in err, err


def test_the_fit_line_names_the_rollouts_when_they_set_the_peak(capsys):
    assert main([*PLAN, "--seq-len", "1048576", "--task", "grpo", "--rollout-tokens", "150000", *PER_RANK]) == 0
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


def test_sequence_parallel_rollouts_bind_per_sp_group(capsys):
    """grpo at 1M tokens per micro-batch with 32M rollout tokens (many micro-batches' worth) and
    sequence-parallel rollouts (the default): the rollouts of the SP group bind, the answer counts
    them per SP group, says a larger SP degree shrinks each GPU's share, and the figure that fits
    is checked by planning with it (fits) and with a tenth more (does not)."""
    base = [*PLAN, "--seq-len", "1048576", "--task", "grpo"]
    assert main([*base, "--rollout-tokens", "33554432"]) == 1
    err = capsys.readouterr().err
    for said in ("the rollouts set it", "generating 33554432 tokens per SP group", "1/SP of their KV cache"):
        assert said in err, (said, err)
    fit = int(re.search(r"At most ([\d,]+) rollout tokens per SP group fit", err).group(1).replace(",", ""))
    assert 2 * 2**20 < fit < 33554432, err
    assert main([*base, "--rollout-tokens", str(fit)]) == 0
    out = capsys.readouterr().out
    assert "generation=" not in out and "# rollouts: sequence-parallel" in out, out[-1500:]
    assert main([*base, "--rollout-tokens", str(fit * 11 // 10)]) == 1
    capsys.readouterr()


def test_generation_applies_to_the_rollout_tasks_only(capsys):
    assert main([*PLAN, "--seq-len", "65536", "--task", "sft", *PER_RANK]) == 2
    err = capsys.readouterr().err
    assert "--generation per-rank applies to --task grpo or rloo, not --task sft" in err, err


@pytest.mark.parametrize("gpus,tokens,cache", [(4, 1 << 19, "auto"), (8, 2 << 20, "auto"), (8, 2 << 20, "device"),
                                               (32, 24 << 20, "auto"), (64, 24 << 20, "auto")])
def test_sequence_parallel_rollouts_reach_the_targets(gpus, tokens, cache):
    """Llama-3.1-8B on 80 GB GPUs (2 TiB host per node), the rollouts of a micro-batch generated on the
    training GPUs: >= 0.5M tokens on 4 GPUs, >= 2M on 8 (also with the cache kept on the device),
    >= 0.9x SFT's longest (27M, capped) on 32 and 64 -- the per-rank path's were 0.09M to 0.19M."""
    from hf_longctx.capacity.cluster import Cluster
    from hf_longctx.capacity.search import rank_settings
    from hf_longctx.cli.inputs import load_config

    cluster = Cluster(gpus=gpus, gpu_memory=80 * 2**30, host_memory=2048 * 2**30)
    ranked = rank_settings(load_config(CONFIG), cluster, tokens, task="grpo", rollout_tokens=tokens,
                           rollout_cache=cache)
    assert ranked[0].feasible, ranked[0].reason
    m = ranked[0].memory
    assert m.generation > 0 and m.generation_weights in ("gathered", "sharded"), m
    assert cache == "auto" or m.generation_cache == cache, m
