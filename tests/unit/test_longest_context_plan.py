"""`hf-longctx plan` at the published longest-context anchors: feasible, laid out per the USP
guidance, the binding resource named right, sizes without a unit refused.

Anchors (the model: the repository's Llama-3.1-8B and Llama-3-70B configs; 80 GB GPUs; host
memory as a DGX-class node has it): 8B at >= 1M tokens on 1 GPU with 512 GiB host (ALST: 500K),
>= 2M on 1 GPU of 141 GB with 1 TiB host (ALST: 1.2M), >= 4M on 4 GPUs of a 2 TiB node (FPDT:
2M), >= 6M on 8 GPUs (ALST: 3.8M), >= 12M on 32 GPUs as node-wide Ulysses x ring, 16M as
Ulysses over all 32 with FPDT chunks and 24M with some layer inputs kept on the GPUs (ALST:
15.5M); 70B >= 512K on 8 GPUs
(ALST: 200K). Layouts: Ulysses inside a node as wide as the node and the heads allow, ring
only across nodes (USP §4).
"""

from __future__ import annotations

import argparse
import os

import pytest

from hf_longctx.cli import main
from hf_longctx.cli.inputs import load_config, parse_size
from hf_longctx.capacity.search import Cluster, Setting, suggest

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
LLAMA_8B, LLAMA_70B = os.path.join(DATA, "llama-3.1-8b-config.json"), os.path.join(DATA, "llama-3-70b-config.json")
G = 2**30
ANCHORS = [  # (config, GPUs, GPU memory, host memory per node, tokens, published figure)
    (LLAMA_8B, 1, 80 * G, 512 * G, 1 << 20, "ALST 500K"),
    (LLAMA_8B, 1, 141 * G, 1024 * G, 2 << 20, "ALST 1.2M"),
    (LLAMA_8B, 4, 80 * G, 2048 * G, 4 << 20, "FPDT 2M"),
    (LLAMA_8B, 8, 80 * G, 2048 * G, 6 << 20, "ALST 3.8M"),
    (LLAMA_8B, 32, 80 * G, 2048 * G, 12 << 20, "ALST 15.5M, node-wide Ulysses x ring"),
    (LLAMA_70B, 8, 80 * G, 2048 * G, 512 << 10, "ALST 200K"),
]


def test_past_the_ring_layouts_ulysses_spans_the_nodes():
    """8B at 16M on 32 GPUs (ALST: 15.5M, Ulysses over all 32): node-wide Ulysses x ring 4 no
    longer fits (the ring's K/V and gradient buffers per token); Ulysses over the whole group
    does, with FPDT chunks or with the parameters on the host -- ALST's layout. The step-time
    model puts both within 0.5 % (the attention kernels are nearly all of the step), so the
    suggestion is either; FPDT chunks without parameter offload are among the tied rows."""
    config = load_config(LLAMA_8B)
    cluster = Cluster(gpus=32, gpu_memory=80 * G, host_memory=2048 * G)
    best = suggest(config, cluster, 16 << 20)
    s, m = best.candidate.setting, best.candidate.memory
    assert m.peak <= 0.9 * 80 * G and m.host * 8 <= 0.9 * 2048 * G
    assert s.ulysses == 32 and s.ring == 1 and (s.fpdt_chunks > 1 or s.param_offload), s
    from hf_longctx.capacity.search import rank_settings

    tied = [c.setting for c in rank_settings(config, cluster, 16 << 20) if c.tied]
    assert any(t.ulysses == 32 and t.fpdt_chunks > 1 and not t.param_offload for t in tied), tied


def test_24m_on_32_gpus_keeps_some_layer_inputs_on_the_gpu():
    """8B at 24M on 32 GPUs (ALST: 15.5M): with every layer input on the host, 8 ranks of 750K
    tokens need more than a 2 TiB node's usable host memory; the GPUs have room, so the planner
    keeps the inputs of the fewest last layers there (patch(..., inputs_on_device=N)) -- one
    fewer does not fit the host -- and says so in the code it prints."""
    from dataclasses import replace

    from hf_longctx.capacity.estimate import ModelDims, estimate_memory

    config = load_config(LLAMA_8B)
    cluster = Cluster(gpus=32, gpu_memory=80 * G, host_memory=2048 * G)
    tokens = 24 << 20
    best = suggest(config, cluster, tokens)
    s, m = best.candidate.setting, best.candidate.memory
    assert s.ulysses == 32 and s.ring == 1 and s.fpdt_chunks > 1 and s.inputs_on_device > 0, s
    assert m.peak <= 0.9 * 80 * G and m.host * 8 <= 0.9 * 2048 * G
    fewer = estimate_memory(ModelDims.from_config(config), replace(s, inputs_on_device=s.inputs_on_device - 1),
                            world=32, tokens=tokens)
    assert fewer.host * 8 > 0.9 * 2048 * G
    assert f"memory='max', inputs_on_device={s.inputs_on_device})" in best.code()
    assert f"--inputs-on-device {s.inputs_on_device}" in best.recipe_flags()


@pytest.mark.parametrize("path,gpus,gpu,host,tokens,published", ANCHORS, ids=[a[-1] for a in ANCHORS])
def test_anchor_is_feasible_and_follows_the_usp_guidance(path, gpus, gpu, host, tokens, published):
    config = load_config(path)
    cluster = Cluster(gpus=gpus, gpu_memory=gpu, host_memory=host)
    best = suggest(config, cluster, tokens)
    s, m = best.candidate.setting, best.candidate.memory
    assert m.peak <= 0.9 * gpu and m.host * min(gpus, 8) <= 0.9 * host  # fits, with the 10 % headroom
    assert cluster.follows_usp_guidance(s, config.num_attention_heads, config.num_key_value_heads), s
    assert s.ulysses == min(gpus, 8) and s.ring == max(1, gpus // 8), s  # Ulysses fills the node, ring across
    assert best.memory in ("high", "max")


def test_the_usp_guidance_check():
    node = Cluster(gpus=32, gpu_memory=80 * G, host_memory=2048 * G)
    assert node.follows_usp_guidance(Setting(8, 4), 32, 8)  # node-wide Ulysses, ring over the 4 nodes
    assert not node.follows_usp_guidance(Setting(1, 32), 32, 8)  # pure ring: ring hops inside nodes
    assert not node.follows_usp_guidance(Setting(32, 1), 32, 8)  # Ulysses across nodes
    assert not node.follows_usp_guidance(Setting(4, 8), 32, 8)  # ring inside a node
    assert node.follows_usp_guidance(Setting(4, 1), 32, 8) and not node.follows_usp_guidance(Setting(2, 2), 32, 8)
    assert node.usp_ulysses(16, heads=12, kv_heads=4) == 4  # 12 heads: Ulysses 8 cannot split them


def test_host_memory_is_named_when_it_binds(capsys):
    """8B at 1M tokens on one GPU with 256 GiB host: the settings that fit the GPU (parameters,
    gradients and optimizer states offloaded, layer inputs on the host) need more host memory,
    so host memory binds -- not GPU memory."""
    args = ["plan", "--model", LLAMA_8B, "--gpus", "1", "--gpu-memory", "80GiB", "--host-memory", "256GiB",
            "--seq-len", str(1 << 20)]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "HOST memory binds" in err and "fits the GPU" in err and "GPU memory binds" not in err


def test_sizes_without_a_unit_are_refused(capsys):
    with pytest.raises(argparse.ArgumentTypeError, match=r"'80' has no unit .* 80GiB"):
        parse_size("80")
    assert parse_size("80GiB") == 80 * G and parse_size("1e9B") == 1e9
    with pytest.raises(SystemExit):
        main(["plan", "--model", LLAMA_8B, "--gpus", "1", "--gpu-memory", "80", "--host-memory", "512GiB",
              "--seq-len", "1024"])
    assert "has no unit" in capsys.readouterr().err
