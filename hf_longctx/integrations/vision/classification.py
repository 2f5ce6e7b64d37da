"""The classification table of image-text-to-text models: EXACT (with its adapter) or REFUSED (with the cause).

Where it sits: read by `registry.py`. One row per model type of transformers'
`MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`; `benchmarks/vlm_zoo.py` measures every EXACT
row (loss and every gradient against one process on packed rows with images) and
`tests/unit/test_vision_classification.py` checks that the table covers the installed
transformers. A cause names what breaks exactness (or what has no adapter yet), so the
user knows whether a setting, another class or no SP is the way forward.
"""

from __future__ import annotations

from hf_longctx.integrations.vision.families import BatchFamily, GridFamily

EXACT, REFUSED, UNCLASSIFIED = "EXACT", "REFUSED", "UNCLASSIFIED"

# Families whose images train exactly under SP (measured by benchmarks/vlm_zoo.py).
ADAPTERS = {
    "qwen2_vl": GridFamily("qwen2_vl"),
    "qwen2_5_vl": GridFamily("qwen2_5_vl"),
    "qwen3_vl": GridFamily("qwen3_vl"),
    "qwen3_vl_moe": GridFamily("qwen3_vl_moe"),
    "qwen3_5": GridFamily("qwen3_5"),
    "qwen3_5_moe": GridFamily("qwen3_5_moe"),
    "gemma3": BatchFamily("gemma3"),
    "llava": BatchFamily("llava"),
}

# Causes, shared by several rows.
_ENC_DEC = "an encoder-decoder: the text decoder cross-attends to an encoder's states (not a causal LM over one sequence)"
_CROSS = "cross-attention layers read the image states from every text position (the text queries would need every image key on every rank)"
_NOT_LM = "not a text-generating causal LM"

REFUSALS: dict[str, str] = {}


def verdict(model_type: str, class_name: str = "") -> tuple[str, object]:
    """(EXACT, adapter) | (REFUSED, cause) | (UNCLASSIFIED, message) for a model type."""
    if model_type in ADAPTERS:
        return EXACT, ADAPTERS[model_type]
    if model_type in REFUSALS:
        return REFUSED, REFUSALS[model_type]
    return UNCLASSIFIED, (
        f"model type '{model_type}' ({class_name or '?'}) is not yet classified for images under sequence parallelism "
        "(no adapter has been measured exact for it)"
    )
