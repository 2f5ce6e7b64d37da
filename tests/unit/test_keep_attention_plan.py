"""keep_attention in the planner, the budget and the recipes' flags.

The memory budget of memory="max" charges keep_attention's kept output and LSE per token and
layer on the host (pinned, per FPDT chunk) and their device copies in the backward (its own and
the next layer's, prefetched); the step-time model drops the attention's recomputed forward and
adds the PCIe bytes of the kept tensors. `hf-longctx plan` offers every "max" setting with and
without it: where the host has room it is the faster one and the suggestion says so
(`keep_attention=True`, `--keep-attention`); where the host binds it is not chosen. The recipes
pass --keep-attention to patch() with --memory max only.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

import pytest

from hf_longctx.capacity.estimate import ModelDims, estimate_memory
from hf_longctx.capacity.search import Cluster, preset_setting, suggest
from hf_longctx.cli.capacity import load_config

from tests.helpers.recipe_launch import recipe_modules

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA_8B = os.path.join(ROOT, "tests", "data", "llama-3.1-8b-config.json")

G = 2**30


def test_the_budget_charges_the_kept_output_and_lse():
    dims = ModelDims.from_config(load_config(LLAMA_8B))
    tokens = 1 << 20
    for u in (1, 8):
        s = preset_setting(8, 1, u, "max", dims)
        plain, kept = (estimate_memory(dims, replace(s, keep_attention=k), world=8, tokens=tokens) for k in (False, True))
        per_token = (dims.heads * dims.head_dim * 2 + 4 * dims.heads) * tokens / 8  # bf16 out + fp32 lse, per GPU
        assert kept.host - plain.host >= dims.layers * per_token  # pinned size classes round up, never down
        assert kept.host - plain.host <= 1.3 * dims.layers * per_token
        assert kept.peak >= plain.peak  # the next layer's copy, prefetched in the backward


def test_the_planner_keeps_the_attention_where_the_host_allows():
    config = load_config(LLAMA_8B)
    roomy = suggest(config, Cluster(gpus=8, gpu_memory=80 * G, host_memory=2048 * G), 512 << 10)
    if roomy.memory == "max":
        assert roomy.candidate.setting.keep_attention, roomy.candidate.setting
    tight = suggest(config, Cluster(gpus=32, gpu_memory=80 * G, host_memory=2048 * G), 24 << 20)
    assert not tight.candidate.setting.keep_attention  # the host binds: layer inputs go to the GPU instead
    s = replace(roomy.candidate.setting, keep_attention=True)
    shown = replace(roomy, memory="max", candidate=replace(roomy.candidate, setting=s))
    assert "keep_attention=True" in shown.code() and "--keep-attention" in shown.recipe_flags()


def test_recipes_pass_keep_attention_with_memory_max_only(capsys):
    (common,) = recipe_modules("common")
    p = common.add_common_args(argparse.ArgumentParser())
    args = common.check_common_args(p, p.parse_args(["--memory", "max", "--keep-attention"]))
    assert common.patch_kwargs(args) == {"memory": "max", "keep_attention": True}
    with pytest.raises(SystemExit):
        common.check_common_args(p, p.parse_args(["--memory", "high", "--keep-attention"]))
    assert "--keep-attention keeps the attention of memory='max''s row-chunked layers" in capsys.readouterr().err
