"""One rule for "which modules are the decoder layers" (hf_longctx/model_walk.py), used by
the memory features, the FSDP2 plan, verify() and the meta-device dry run.

Before it there were three rules: the memory features took the longest list of layers with
an MLP, verify() the list with the most parameters, the FSDP plan the classes named in
`_no_split_modules`. On GOT-OCR2 the first two picked the vision tower (as many blocks as
the text decoder) and the third the text decoder; on Phi-4-multimodal verify() picked the
24-block audio encoder. Here every family resolves to its text decoder's layer list, and
the FSDP plan's classes are that list's classes.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from benchmarks.zoo import tiny_config
from hf_longctx.model_walk import decoder_layer_classes, decoder_layers, hf_model, layer_mlp


def _meta(model_type: str):
    with torch.device("meta"):
        return tf.AutoModelForCausalLM.from_config(tiny_config(tf.CONFIG_MAPPING[model_type]))


def _text_layers(model):
    """The layer list of the model's language model, found by name (independent of the rule)."""
    decoder = model.get_decoder()
    for attr in ("layers", "h", "layer", "blocks"):
        found = getattr(decoder, attr, None)
        if isinstance(found, torch.nn.ModuleList):
            return found
    raise AssertionError(f"{type(decoder).__name__} keeps its layers under no known name")


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "bamba", "got_ocr2", "gemma3", "phi4_multimodal"])
def test_decoder_layers_are_the_text_decoders_layers(model_type):
    model = _meta(model_type)
    layers = decoder_layers(model)
    assert layers is _text_layers(model)
    assert set(decoder_layer_classes(model)) == {type(layer) for layer in layers}


def test_decoder_layers_through_a_peft_wrapper():
    peft = pytest.importorskip("peft")
    model = tf.AutoModelForCausalLM.from_config(tiny_config(tf.CONFIG_MAPPING["llama"]))
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert hf_model(wrapped) is model
    assert decoder_layers(wrapped) is model.model.layers
    assert all(layer_mlp(layer) is layer.mlp for layer in decoder_layers(wrapped))


def test_a_family_without_mlp_names_falls_back_to_the_heaviest_list():
    model = _meta("xlnet")
    assert decoder_layers(model) is model.transformer.layer


def test_hf_model_refuses_other_modules():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        hf_model(torch.nn.Linear(2, 2))
