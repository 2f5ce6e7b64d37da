"""The memory options find the decoder layers and their MLPs on every family, in one process.

The families that name their MLP `feed_forward` (Bamba, Jamba, Granite-4, Falcon-H1,
LFM2) must get `mlp_chunks` and `checkpoint` like those that name it `mlp`
(`model_walk.decoder_layers` / `layer_mlp`). Here the options are applied to such a model,
and the loss and every gradient must equal the model without them (same process, same
input: chunking the token-wise MLP and recomputing a layer change nothing beyond fp32
summation order).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from benchmarks.zoo import tiny_config
from hf_longctx.distributed.mesh import init_sequence_parallel
from hf_longctx.config import PatchOptions
from hf_longctx.integrations.memory import apply_memory_options
from hf_longctx.model_walk import decoder_layers, layer_mlp


def _build(model_type: str):
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(tiny_config(tf.CONFIG_MAPPING[model_type]), dtype=torch.float32).train()


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", ["bamba", "lfm2"])
def test_feed_forward_families_take_mlp_chunks_and_checkpointing(model_type):
    model = _build(model_type)
    layers = decoder_layers(model)
    assert layers is model.model.layers
    assert all(layer_mlp(layer) is layer.feed_forward for layer in layers)
    ids = torch.randint(3, 100, (1, 24), generator=torch.Generator().manual_seed(0))
    ref_loss, ref_grads = _loss_and_grads(model, ids)
    calls = []
    linear = next(m for m in layer_mlp(layers[0]).modules() if isinstance(m, torch.nn.Linear))
    hook = linear.register_forward_hook(lambda *_: calls.append(1))  # a chunked MLP calls it once per chunk
    undo = apply_memory_options(model, init_sequence_parallel(), PatchOptions(mlp_chunks=3, checkpoint=True))
    try:
        loss, grads = _loss_and_grads(model, ids)
    finally:
        undo()
        hook.remove()
    assert len(calls) >= 3  # the MLP ran in chunks (a recompute adds more calls)
    torch.testing.assert_close(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], msg=lambda m, n=n: f"{n}: {m}")
    assert "forward" not in layer_mlp(layers[0]).__dict__  # undone


def test_no_decoder_layers_is_a_clear_error():
    with pytest.raises(ValueError, match="found no list of decoder layers"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))
