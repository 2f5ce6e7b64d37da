"""`hf-longctx plan --task sft|dpo|grpo|rloo` suggests what the task's trainer and recipe take
(capacity/suggestion.py `TASK_TRAINERS`): every printed recipe flag parses with the named
recipe's own parser to the suggested values, and the printed code names the task's trainer
with keyword arguments its `__init__` chain accepts, `patch` options that exist and the
`init_sequence_parallel` degrees. The rollout trainers (GRPO, RLOO) take neither
`param_offload` nor `sync_each_microbatch` nor `tokens_per_step`: the planner searches no
parameter offload for them and prints none of those."""

from __future__ import annotations

import inspect
import os
import re
import shlex
import types

import pytest

from tests.helpers.recipe_launch import recipe_modules

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "tests", "data", "llama-3.1-8b-config.json")
TRAINERS = {"sft": "LongContextTrainer", "dpo": "LongDPOTrainer", "dpo-precomputed": "LongDPOTrainer", "grpo": "LongGRPOTrainer", "rloo": "LongRLOOTrainer"}
# the recipes' own required options that a plan does not print
SFT_REQUIRED = ["--model", "m", "--dataset", "text", "--steps", "1", "--output-dir", "out"]


def _recipe_parsers(task: str) -> dict:
    """{recipe: argv -> Namespace} with each recipe's own parser."""
    if task == "sft":
        pretrain, sft = recipe_modules("pretrain", "sft")
        return {"pretrain.py": lambda a: pretrain.parse_args(pretrain.build_parser("pretrain"), SFT_REQUIRED + a),
                "sft.py": lambda a: sft.parse_args(SFT_REQUIRED + a)}
    recipe = task.split("-")[0]  # dpo-precomputed: recipes/dpo.py
    (module,) = recipe_modules(recipe)
    return {f"{recipe}.py": module.parse_args}


def _candidate(param_offload: bool):
    from hf_longctx.capacity.estimate import Setting

    s = Setting(ulysses=4, ring=2, fpdt_chunks=1, checkpoint=True, param_offload=param_offload, inputs_on_device=3)
    return types.SimpleNamespace(setting=s, dp=2, microbatches=3, preset="max")


def _accepted_keywords(cls) -> set[str]:
    """The keyword names `cls(...)` accepts: each `__init__` along the MRO while the previous one
    passes **kwargs on."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass is object:
            continue
        params = inspect.signature(vars(klass)["__init__"]).parameters.values()
        names |= {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


def _check_code(code: str, task: str) -> None:
    import hf_longctx
    from hf_longctx.integrations.model_patch import patch

    init, patched, trainer, *note = code.splitlines()
    kw = lambda text: dict(re.findall(r"(\w+)=([^,()]+(?:\([^)]*\))?)", text))  # noqa: E731
    assert set(kw(init)) <= set(inspect.signature(hf_longctx.init_sequence_parallel).parameters), init
    assert set(kw(patched.split("mesh,", 1)[1])) <= set(inspect.signature(patch).parameters) - {"model", "mesh"}, patched
    name = re.match(r"trainer = hf_longctx\.(\w+)\(", trainer).group(1)
    assert name == TRAINERS[task], trainer
    given = set(kw(trainer.split("(", 1)[1])) - {"..."}
    assert given <= _accepted_keywords(getattr(hf_longctx, name)), (given - _accepted_keywords(getattr(hf_longctx, name)))
    if task == "dpo":
        assert "DPOConfig(..., max_length=None)" in trainer and "whole pairs" in note[0], code
    if task == "dpo-precomputed":
        assert "precompute_ref_log_probs=True)" in trainer and "not held during training" in note[0], code
    if task in ("grpo", "rloo"):
        assert f"{task.upper()}Config(...)" in trainer and "rows are TRL's" in note[0], code


def _check_flags(flags: str, task: str, suggestion) -> None:
    """Every flag parses with each of the task's recipes, to the suggested values."""
    k, t = suggestion.init_kwargs, suggestion.trainer_kwargs
    for recipe, parse in _recipe_parsers(task).items():
        args = parse(shlex.split(flags))
        got = (args.ulysses, args.ring, args.fpdt_chunks, args.memory, args.inputs_on_device, args.max_tokens,
               args.mixed_precision, args.param_offload, args.sync_each_microbatch)
        want = (k["ulysses_degree"], k["ring_degree"], k["fpdt_chunks"], suggestion.memory,
                suggestion.candidate.setting.inputs_on_device, t["max_tokens"], suggestion.mixed_precision,
                t.get("param_offload", False), t.get("sync_each_microbatch", False))
        assert got == want, (recipe, got, want)
        if recipe == "dpo.py":  # the precomputed reference reaches DPOConfig through this flag only
            assert args.precompute_ref_log_probs is (task == "dpo-precomputed"), (task, flags)
        if "tokens_per_step" in t:
            assert args.tokens_per_step == t["tokens_per_step"], recipe


@pytest.mark.parametrize("task", ["sft", "dpo", "dpo-precomputed", "grpo", "rloo"])
def test_suggestion_speaks_the_task_trainer_and_recipe(task):
    from hf_longctx.capacity.suggestion import Suggestion

    rollout = task in ("grpo", "rloo")
    s = Suggestion.of(_candidate(param_offload=not rollout), 4096, grad_sync="microbatch", task=task)
    assert s.recipes == {"sft": "recipes/pretrain.py, lora.py, sft.py"}.get(task, f"recipes/{task.split('-')[0]}.py")
    want = {"max_tokens": 4096} if rollout else {"max_tokens": 4096, "tokens_per_step": 4096 * 2 * 3,
                                                 "param_offload": True, "sync_each_microbatch": True}
    assert s.trainer_kwargs == want, s.trainer_kwargs
    _check_code(s.code(), task)
    _check_flags(s.recipe_flags(), task, s)
    if rollout:
        with pytest.raises(ValueError, match=f"{TRAINERS[task]} takes no param_offload"):
            Suggestion.of(_candidate(param_offload=True), 4096, task=task)


@pytest.mark.parametrize("task", ["grpo", "rloo"])
def test_rollout_tasks_search_no_parameter_offload(task):
    from hf_longctx.capacity.cluster import Cluster
    from hf_longctx.capacity.search import rank_settings
    from hf_longctx.cli.inputs import load_config

    config, cluster = load_config(CONFIG), Cluster(gpus=8, gpu_memory=80 * 2**30, host_memory=2**40)
    ranked = rank_settings(config, cluster, 65536, param_offload="auto", task=task)
    assert ranked and not any(c.setting.param_offload for c in ranked)
    with pytest.raises(ValueError, match=f"{TRAINERS[task]} takes no param_offload"):
        rank_settings(config, cluster, 65536, param_offload="yes", task=task)
    with pytest.raises(ValueError, match="flexible SP groups"):
        rank_settings(config, cluster, 65536, unsharded_step=True, task=task)


@pytest.mark.parametrize("task,extra", [("sft", []), ("dpo", ["--sync-each-microbatch", "--microbatches", "2"]),
                                        ("grpo", ["--rollout-tokens", "100000"]),
                                        ("rloo", ["--rollout-tokens", "100000"])])
def test_plan_prints_the_task_suggestion(task, extra, capsys):
    """The CLI end to end (the 8B config, host memory binding so inputs_on_device is printed);
    `--task dpo` suggests the reference it picks, the precomputed one (test_dpo_reference_plan.py)."""
    from hf_longctx.capacity.suggestion import Suggestion
    from hf_longctx.cli import main

    printed = "dpo-precomputed" if task == "dpo" else task

    assert main(["plan", "--model", CONFIG, "--gpus", "8", "--gpu-memory", "80GiB", "--host-memory", "256GiB",
                 "--seq-len", "1048576", "--task", task, "--top", "1", *extra]) == 0
    out = capsys.readouterr().out
    code = out.split("):\nmesh = ", 1)[1].split("\n\n", 1)[0]
    recipes, flags = re.search(r"as recipe flags \(([^)]*)\):\n(.*)\n", out).groups()
    assert recipes == Suggestion.of(_candidate(False), 1, task=task).recipes
    _check_code("mesh = " + code, printed)
    for recipe, parse in _recipe_parsers(printed).items():
        args = parse(shlex.split(flags))
        assert args.max_tokens == 1048576 and args.memory in ("high", "max") and args.inputs_on_device > 0, (recipe, flags)
        assert getattr(args, "precompute_ref_log_probs", False) is (printed == "dpo-precomputed"), (recipe, flags)
    assert ("--sync-each-microbatch" in flags) == (task == "dpo"), flags
    assert ("--tokens-per-step" in flags) == (task in ("sft", "dpo")), flags


def test_plan_refuses_flexible_groups_for_post_training(capsys):
    from hf_longctx.cli import main

    argv = ["plan", "--model", CONFIG, "--gpus", "8", "--gpu-memory", "80GiB", "--host-memory", "1TiB", "--seq-len", "65536"]
    for flag in ("--unequal-calls", "--flex"):
        assert main([*argv, "--task", "dpo", flag]) == 2
        err = capsys.readouterr().err
        assert "LongDPOTrainer (--task dpo) does not take" in err and f"drop {flag}" in err, err


@pytest.mark.parametrize("task,trainer", [("grpo", "LongGRPOTrainer"), ("rloo", "LongRLOOTrainer")])
def test_plan_refuses_parameter_offload_for_the_rollout_trainers_by_flag(task, trainer, capsys):
    from hf_longctx.cli import main

    assert main(["plan", "--model", CONFIG, "--gpus", "8", "--gpu-memory", "80GiB", "--host-memory", "1TiB",
                 "--seq-len", "65536", "--task", task, "--param-offload", "yes"]) == 2
    err = capsys.readouterr().err
    assert f"--param-offload yes: {trainer} (--task {task}) takes no param_offload" in err and "--param-offload no or auto" in err, err
