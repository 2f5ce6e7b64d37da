"""A config whose sizes differ per layer (transformers' per-layer attributes: Gemma 4's head_dim).

`data/model_dims.ModelDims.from_config` raises ValueError there, as for any config whose sizes it
cannot read (transformers raises its AmbiguousGlobalPerLayerAttributeError, a RuntimeError, on
the global attribute), so the memory options' host-budget check runs without a budget as for
other unreadable configs: a patched Gemma 4 with memory="max"'s knobs (row-chunked layers,
chunked MLP and loss) and "high"'s runs, and equals memory="off" (fp32, one process, two steps;
before, patch() raised the RuntimeError).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

from benchmarks.zoo_configs import tiny_config
from tests.helpers.patched_steps import patched_steps, worst_errors

torch.set_num_threads(1)


def _gemma4():
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(tiny_config(tf.CONFIG_MAPPING["gemma4_text"]), dtype=torch.float32)


def test_per_layer_sizes_are_a_value_error_naming_the_attribute():
    from hf_longctx.data.model_dims import ModelDims

    with pytest.raises(ValueError, match="head_dim"):
        ModelDims.from_config(_gemma4().config)


@pytest.mark.parametrize("options", [dict(checkpoint=True, mlp_chunks=4, loss_chunks="auto"),
                                     dict(checkpoint="attention", mlp_chunks=4, loss_chunks="auto")],
                         ids=["max-knobs", "high-knobs"])
def test_gemma4_runs_under_the_memory_options(options):
    base = _gemma4()
    loss_err, grad_err = worst_errors(patched_steps(copy.deepcopy(base), **options),
                                      patched_steps(copy.deepcopy(base), memory="off"))
    assert loss_err <= 1e-6 and grad_err <= 1e-5, (loss_err, grad_err)
