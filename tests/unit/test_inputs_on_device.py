"""`patch(..., inputs_on_device=N)`: the last N decoder layers keep their checkpointed inputs on
the device instead of pinned host memory (`integrations/checkpointing.park`), the planner's
budget moves exactly those bytes from host to device, and every other argument combination
that cannot honour it is refused before the model changes.

The offload path runs on CPU with the emulated CUDA streams of `benchmarks/census.py` (real
copies into a host pool), so the layer inputs that go to the host are the ones a GPU run
would offload; the count is taken at `copy_out`, where every parked input starts its copy.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.census import EmulatedStreams, emulated_offload
from hf_longctx import init_sequence_parallel, patch, shard_batch, unpatch
from hf_longctx.config import PatchOptions
from hf_longctx.integrations import checkpointing
from hf_longctx.ops.host_pool import size_class
from hf_longctx.capacity.budget import step_budget
from hf_longctx.capacity.estimate import ModelDims

LAYERS, HIDDEN, TOKENS = 4, 64, 256


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                        max_position_embeddings=1024))


def _step(model, mesh, ids):
    out = model(**shard_batch({"input_ids": ids, "labels": ids.clone()}, mesh))
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), grads


@pytest.mark.parametrize("memory,fpdt", [("max", 1), ("max", 2), ("high", 2)])
def test_the_last_layers_inputs_stay_on_the_device_and_the_step_is_exact(monkeypatch, memory, fpdt):
    """Emulated offload, 4 layers, inputs_on_device=2: the layer inputs copied to the host are
    those of the first 2 layers only (4 with inputs_on_device=0: the counter sees them); loss and
    gradients equal the unpatched model's (fp32: loss 1e-5, gradients 1e-4 relative)."""
    ids = torch.randint(0, 128, (1, TOKENS), generator=torch.Generator().manual_seed(1))
    ref_model = _model()
    ref_loss, ref_grads = _step(ref_model, init_sequence_parallel(1, 1), ids)  # unpatched: plain HF

    parked = []
    copy_out = checkpointing.copy_out

    def counting(streams, tensors):  # every parked layer input starts its host copy here
        parked.extend(t.shape for t in tensors)
        return copy_out(streams, tensors)

    monkeypatch.setattr(checkpointing, "copy_out", counting)
    for kept in (0, 2):
        model, mesh = _model(), init_sequence_parallel(1, 1, fpdt_chunks=fpdt)
        parked.clear()
        with emulated_offload(EmulatedStreams()):
            patch(model, mesh, memory=memory, inputs_on_device=kept)
            model.train()
            loss, grads = _step(model, mesh, ids)
            unpatch(model)
        assert parked == [torch.Size([1, TOKENS, HIDDEN])] * (LAYERS - kept), (kept, parked)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_refused_where_it_cannot_be_honoured():
    """Without checkpointing there is no layer input to keep; more layers than the model has, a
    negative or a bool count: each refused naming the value, before the model changes."""
    with pytest.raises(ValueError, match=r"inputs_on_device=2 .* checkpointing is off \(memory='balanced'"):
        PatchOptions.resolve("balanced", {}, 1, inputs_on_device=2)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="inputs_on_device must be an int"):
            PatchOptions.resolve("max", {}, 1, inputs_on_device=bad)
    assert PatchOptions.resolve("max", {}, 2, inputs_on_device=3).inputs_on_device == 3
    model = _model()
    with pytest.raises(ValueError, match=rf"inputs_on_device must be at most the model's {LAYERS} decoder layers, "
                                         rf"got {LAYERS + 1}"):
        patch(model, init_sequence_parallel(1, 1), memory="max", inputs_on_device=LAYERS + 1)
    assert "_hf_longctx_patch" not in model.__dict__ and "forward" not in model.model.layers[0].__dict__


@pytest.mark.parametrize("memory", ["max", "high"])
def test_the_budget_moves_the_kept_inputs_from_host_to_device(memory):
    """8B, Ulysses 8 with FPDT 8, 1M tokens: each kept layer takes one pinned input buffer off the
    host and puts hidden x 2 bytes per token of the rank on the device, at every phase."""
    from hf_longctx.cli.inputs import load_config
    from hf_longctx.capacity.search import preset_setting

    dims = ModelDims.from_config(load_config("tests/data/llama-3.1-8b-config.json"))
    s = preset_setting(8, 1, 8, memory, dims)
    tokens, kept = 1 << 20, 5
    base, moved = step_budget(dims, s, tokens=tokens), step_budget(dims, replace(s, inputs_on_device=kept), tokens=tokens)
    per_layer = 2 * dims.hidden * tokens / 8
    assert base.host - moved.host == kept * size_class(int(per_layer))
    for a, b in zip(base.phases, moved.phases):
        assert sum(b.terms.values()) - sum(a.terms.values()) == pytest.approx(kept * per_layer), a.name
