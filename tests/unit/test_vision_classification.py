"""Every image-text-to-text model type of the installed transformers is classified, and the
table agrees with its measurement (benchmarks/results/vlm_zoo.json, `benchmarks/vlm_zoo.py`).

A model type the table does not know (a new transformers release) is "not yet classified" and
refused by name; a refused family's images are refused at the patched model with the cause,
while its text-only batches still run.
"""

from __future__ import annotations

import json
import os

import pytest

from hf_longctx.integrations.vision.classification import ADAPTERS, EXACT, REFUSALS, REFUSED, UNCLASSIFIED, verdict

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results", "vlm_zoo.json")


def test_every_image_text_to_text_type_is_classified():
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    types = set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    assert not set(ADAPTERS) & set(REFUSALS)
    unclassified = sorted(types - set(ADAPTERS) - set(REFUSALS))
    assert not unclassified, f"image-text-to-text model types without a verdict: {unclassified}"
    for t in types:
        status, detail = verdict(t)
        assert status in (EXACT, REFUSED)
        assert status == EXACT or (isinstance(detail, str) and len(detail) > 20), (t, detail)
    for name in ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "gemma3"):  # the families the exactness tests cover
        assert verdict(name)[0] == EXACT


def test_the_table_agrees_with_its_measurement():
    with open(RESULTS) as f:
        rows = {r["model_type"]: r for r in json.load(f)}
    exact = {t for t, r in rows.items() if r["verdict"] == "EXACT"}
    assert exact == set(ADAPTERS), f"measured EXACT but not listed: {exact - set(ADAPTERS)}; listed, not measured: {set(ADAPTERS) - exact}"
    assert set(rows) - exact == set(REFUSALS)


def test_unclassified_and_refused_models_are_named():
    status, message = verdict("a_future_vlm", "FutureVLMForConditionalGeneration")
    assert status == UNCLASSIFIED and "not yet classified" in message and "a_future_vlm" in message


def test_refused_family_refuses_images_at_the_patched_model_but_trains_text():
    import torch
    import transformers as tf

    from hf_longctx import init_sequence_parallel, patch
    from hf_longctx.errors import NotSupported
    from hf_longctx.integrations.vision.registry import vision_spec

    cfg = tf.Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8),
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, image_size=16, patch_size=4, head_dim=8),
        image_token_index=60,
    )
    model = tf.Mistral3ForConditionalGeneration(cfg)
    with pytest.raises(NotSupported, match="mistral3.*no adapter"):
        vision_spec(model)
    patch(model, init_sequence_parallel())
    with pytest.raises(NotSupported, match="cannot train images under sequence parallelism"):
        model(input_ids=torch.tensor([[1, 60, 2]]), pixel_values=torch.zeros(1, 3, 16, 16))
