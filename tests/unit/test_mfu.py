"""MFU's three conventions (capacity/mfu.py) against each source's own arithmetic.

The parameter count N is taken from a real transformers model built on the meta device, the way
torchtitan counts it (every parameter but an embedding not shared with the head); the strict
count equals benchmarks/gpu_throughput.py's numerator for one document; Megatron-DeepSpeed's is
its throughput_calculator's expression written out; the printed line orders the three.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_longctx.capacity.mfu import (
    MEGATRON_DEEPSPEED,
    SOURCES,
    STRICT,
    TORCHTITAN,
    by_convention,
    dense_params,
    mfu_line,
)
from hf_longctx.data.model_dims import ModelDims


def _config(tied: bool) -> LlamaConfig:
    return LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=3, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=32, vocab_size=1000, tie_word_embeddings=tied)


@pytest.mark.parametrize("tied", [False, True])
def test_n_is_torchtitans_parameter_count(tied):
    cfg = _config(tied)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    head = {id(p) for p in model.lm_head.parameters()}
    counted = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n or id(p) in head)
    final_norm = cfg.hidden_size  # torchtitan counts the final norm's weight; 6 x 256 FLOPs per token
    assert dense_params(ModelDims.from_config(cfg)) == counted - final_norm


def test_the_three_counts():
    from benchmarks.gpu_throughput import config as throughput_config
    from benchmarks.gpu_throughput import model_flops

    cfg = throughput_config("8b", 2)
    dims, t = ModelDims.from_config(cfg), 32768
    f = by_convention(dims, t, checkpointed=True)
    norms = 6 * 2 * 2 * 4096 * t  # the planner's N holds the layers' two norm weights; the benchmark's does not
    assert f[STRICT] == pytest.approx(model_flops(cfg, t) + norms, rel=1e-12)
    n, attn = dense_params(dims), 2 * 32 * 128  # L H D
    assert f[TORCHTITAN] == pytest.approx((6 * n + 12 * attn * t) * t, rel=1e-12)
    assert f[TORCHTITAN] - f[STRICT] == pytest.approx(6 * attn * t * t, rel=1e-12)  # the other half of the square
    h, v = 4096, 128256
    assert f[MEGATRON_DEEPSPEED] == pytest.approx(24 * 4 * t * 2 * h**2 * (1 + t / (6 * h) + v / (16 * 2 * h)), rel=1e-12)
    assert by_convention(dims, t)[MEGATRON_DEEPSPEED] == pytest.approx(0.75 * f[MEGATRON_DEEPSPEED], rel=1e-12)
    # documents: strict halves each document's square, torchtitan counts the row's
    two = by_convention(dims, t, seq_len=t // 2)
    assert two[STRICT] < f[STRICT] and two[TORCHTITAN] == f[TORCHTITAN]


def test_the_line_names_each_convention():
    dims = ModelDims.from_config(_config(False))
    line = mfu_line(dims, 4096, 1.0, 1e12, checkpointed=True)
    assert "(strict)" in line and "torchtitan's count" in line and "Megatron-DeepSpeed's" in line, line
    assert all(name in SOURCES for name in (STRICT, TORCHTITAN, MEGATRON_DEEPSPEED))
    assert "torchtitan/models/utils.py" in SOURCES[TORCHTITAN] and "megatron/utils.py" in SOURCES[MEGATRON_DEEPSPEED]
