"""memory="max"'s knobs across model families on one process: two steps equal memory="off".

The zoo (benchmarks/zoo.py) holds every family's default patch against the unpatched model on
two ranks; this holds the row-chunked layers (checkpoint=True with MLP chunks: what `post`
skips is learnt per family, their norms, projections and RoPE functions differ), the chunked
MLP and the chunked loss (with the family's logit scaling and softcap) against the same patch
with memory="off", fp32, over two steps (the second runs with what the first backward learnt):
loss 1e-6 relative, every gradient within 1e-5 of the largest (the chunked sums' order).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

from benchmarks.zoo_configs import tiny_config
from hf_longctx.errors import NotSupported
from tests.helpers.patched_steps import patched_steps, worst_errors

FAMILIES = ["llama", "gemma2", "gemma3_text", "qwen3", "phi3", "olmo2", "cohere2", "granite", "gpt2", "gptj"]


@pytest.mark.parametrize("family", FAMILIES)
def test_max_knobs_equal_memory_off(family):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = tf.AutoModelForCausalLM.from_config(tiny_config(tf.CONFIG_MAPPING[family]), dtype=torch.float32)
    try:
        ref = patched_steps(copy.deepcopy(base), memory="off")
    except NotSupported as e:  # an older transformers' family outside AttentionInterface (GPT-J before 5.2x)
        pytest.skip(f"patch() refuses {family} with this transformers: {str(e).splitlines()[0][:120]}")
    got = patched_steps(copy.deepcopy(base), checkpoint=True, mlp_chunks=4, loss_chunks="auto")
    loss_err, grad_err = worst_errors(got, ref)
    assert loss_err <= 1e-6 and grad_err <= 1e-5, (loss_err, grad_err)
    assert got[2], f"no layer of {family} took the row-chunked path"
