"""`hf-longctx plan` with a vision budget: the tower's parameters, its share of the images and the
embedding exchange are charged to every setting (capacity/vision.py), and bad budgets are refused."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def vl_config(tmp_path_factory):
    import transformers as tf

    cfg = tf.Qwen2_5_VLConfig(
        text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           spatial_merge_size=2, patch_size=14),
    )
    path = tmp_path_factory.mktemp("plan") / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    return cfg, str(path)


def test_budget_charges_memory_and_time(vl_config):
    from hf_longctx.capacity.search import Cluster, rank_settings
    from hf_longctx.capacity.vision import vision_budget

    cfg, _ = vl_config
    cluster = Cluster(gpus=8, gpu_memory=80 * 2**30, host_memory=2**40, gpus_per_node=8,
                      intra_bw=150e9, inter_bw=25e9, pcie_bw=25e9, headroom=0.1, latency=30e-6, cpu_optim_bw=10e9)
    budget = vision_budget(cfg, images=16, image_tokens=1024)
    assert 600e6 < budget.dims.params < 750e6  # Qwen2.5-VL-7B's tower is ~670M parameters
    plain = {(c.setting, c.preset): c for c in rank_settings(cfg, cluster, 65536)}
    charged = {(c.setting, c.preset): c for c in rank_settings(cfg, cluster, 65536, vision=budget)}
    for key, c in charged.items():
        p = plain[key]
        assert c.memory.params > p.memory.params and c.memory.activations > p.memory.activations
        assert c.step_seconds > p.step_seconds
    # the busiest rank's encoder share: 1/sp of the micro-batch plus one image
    patches, tokens = budget.per_rank(1, 8)
    assert patches == 16 * 4096 / 8 + 4096 and tokens == 16 * 1024 / 8


def test_plan_cli_flags(vl_config, capsys):
    from hf_longctx.cli import main

    _, path = vl_config
    base = ["plan", "--model", path, "--gpus", "8", "--gpu-memory", "80GiB", "--host-memory", "1TiB", "--top", "2"]
    assert main([*base, "--seq-len", "131072", "--images", "64", "--image-tokens", "1024"]) == 0
    out = capsys.readouterr().out
    assert "65536 visual tokens per sample" in out and "vision tower 6" in out
    assert main([*base, "--seq-len", "131072", "--video-seconds", "600", "--fps", "2", "--frame-tokens", "64"]) == 0
    assert "600 video slices x 64" in capsys.readouterr().out
    assert main([*base, "--seq-len", "131072", "--images", "4"]) == 2
    assert "needs --image-tokens" in capsys.readouterr().err
    assert main([*base, "--seq-len", "4096", "--images", "8", "--image-tokens", "1024"]) == 2
    assert "more than --seq-len 4096" in capsys.readouterr().err
