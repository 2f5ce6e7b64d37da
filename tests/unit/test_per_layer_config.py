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
from tests.helpers.reference import rel_err

torch.set_num_threads(1)


def _gemma4():
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(tiny_config(tf.CONFIG_MAPPING["gemma4_text"]), dtype=torch.float32)


def test_per_layer_sizes_are_a_value_error_naming_the_attribute():
    from hf_longctx.data.model_dims import ModelDims

    with pytest.raises(ValueError, match="head_dim"):
        ModelDims.from_config(_gemma4().config)


def _two_steps(model, **options):
    from hf_longctx import init_sequence_parallel, patch, unpatch
    from hf_longctx.data.sharding import shard_batch

    mesh = init_sequence_parallel(1, 1)
    patch(model, mesh, **options)
    model.train()
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(1, vocab, (1, 90), generator=torch.Generator().manual_seed(1))
    shard = shard_batch({"input_ids": ids, "labels": ids.clone(),
                         "position_ids": torch.cat([torch.arange(50), torch.arange(40)])[None]}, mesh)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = model(**shard).loss
        loss.backward()
    unpatch(model)
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("options", [dict(checkpoint=True, mlp_chunks=4, loss_chunks="auto"),
                                     dict(checkpoint="attention", mlp_chunks=4, loss_chunks="auto")],
                         ids=["max-knobs", "high-knobs"])
def test_gemma4_runs_under_the_memory_options(options):
    base = _gemma4()
    ref, ref_grads = _two_steps(copy.deepcopy(base), memory="off")
    loss, grads = _two_steps(copy.deepcopy(base), **options)
    assert rel_err(loss, ref) <= 1e-6
    top = max(float(g.abs().max()) for g in ref_grads if g is not None)
    assert all(float((a - b).abs().max()) <= 1e-5 * top for a, b in zip(grads, ref_grads) if b is not None)
