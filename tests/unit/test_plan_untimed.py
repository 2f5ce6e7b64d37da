"""A GPU without measured kernel fractions (A100) gets memory plans and no step time.

capacity/gpus.py: every entry says where its fractions come from, or has none; the step-time
model refuses a card without them (`step_time.UntimedGPU`) instead of timing it with another
card's; `rank_settings` still estimates every setting's memory (the same figures as on an H100
of the same memory) and orders them without a time; `hf-longctx plan --gpu a100` prints the
memory columns, "-" for the time columns and why, and refuses `--flex --plot` (which weighs
groups by modelled seconds).
"""

from __future__ import annotations

import os

import pytest

from hf_longctx.capacity.cluster import Cluster
from hf_longctx.capacity.gpus import GPUS
from hf_longctx.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "tests", "data", "llama-3.1-8b-config.json")
G = 2**30


def test_every_entry_says_where_its_fractions_come_from():
    for name, g in GPUS.items():
        if g.timed:
            assert g.gemm and g.hbm and g.attention, name
        else:  # nothing to inherit silently: arithmetic on them fails
            assert g.gemm is None and g.hbm is None and g.attention == (), name
    assert not GPUS["a100"].timed and "A100" in GPUS["a100"].untimed()
    assert "H200's" in GPUS["h100"].fractions and GPUS["h200"].fractions.startswith("measured")


def test_the_step_time_is_refused_not_borrowed():
    from hf_longctx.capacity.estimate import ModelDims
    from hf_longctx.capacity.search import preset_setting
    from hf_longctx.capacity.step_time import UntimedGPU, step_time
    from hf_longctx.cli.inputs import load_config

    dims = ModelDims.from_config(load_config(CONFIG))
    with pytest.raises(UntimedGPU, match="no measured kernel fractions for A100 SXM: the step time cannot be modelled"):
        step_time(dims, preset_setting(1, 1, 1, "max", dims), Cluster(1, 80 * G, 2048 * G, gpu="a100"), 32768)


def test_memory_plans_stand_and_are_ordered_without_a_time():
    from hf_longctx.capacity.estimate import ModelDims
    from hf_longctx.capacity.search import rank_settings, untimed_order
    from hf_longctx.cli.inputs import load_config

    config = load_config(CONFIG)
    a100 = rank_settings(config, Cluster(8, 80 * G, 512 * G, gpu="a100"), 1 << 17)
    h100 = rank_settings(config, Cluster(8, 80 * G, 512 * G, gpu="h100"), 1 << 17)
    assert all(c.time is None for c in a100)
    memory = lambda ranked: {(c.setting, c.preset): (c.memory.peak, c.memory.host, c.feasible) for c in ranked}  # noqa: E731
    assert memory(a100) == memory(h100)
    dims = ModelDims.from_config(config)
    keys = [untimed_order(c, Cluster(8, 80 * G, 512 * G, gpu="a100"), dims) for c in a100]
    assert keys == sorted(keys) and a100[0].feasible


def test_plan_prints_the_memory_and_why_there_is_no_time(capsys):
    argv = ["plan", "--model", CONFIG, "--gpus", "8", "--gpu-memory", "80GiB", "--host-memory", "512GiB",
            "--seq-len", "131072", "--top", "2", "--gpu", "a100"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "no measured kernel fractions for A100 SXM: the step time cannot be modelled; memory plans only" in out
    row = [line for line in out.splitlines() if line.startswith("| 1 ")][0]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[-5:-1] == ["-", "-", "-", "-"], row  # step s, tok/s/GPU, MFU %, binds
    assert "suggested (the first that fits, in the order above: no step time" in out
    assert main([*argv, "--flex", "--plot", "/dev/null"]) == 2
    assert "--flex --plot weighs flexible groups by modelled seconds" in capsys.readouterr().err
