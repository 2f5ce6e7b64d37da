"""Which image-text-to-text models train images exactly under SP, and why the others do not.

Where it sits: `patch()` asks `vision_family(hf)` for the adapter it binds (its vision hook)
and the vision sub-configs it must leave alone (the tower keeps its own attention);
`vision_spec(model)` gives the data stage its `VisionSpec`. The verdicts are a table, one row
per model type of transformers' `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`
(`classification.py`), measured by `benchmarks/vlm_zoo.py` and printed in docs/measured/models.md; a model
type missing from it is "not yet classified" and refused with that name, so a new
transformers release cannot slip an unchecked family through.
"""

from __future__ import annotations

from typing import Any

from hf_longctx.errors import NotSupported
from hf_longctx.integrations.vision.classification import EXACT, verdict
from hf_longctx.model_walk import PATCH_STATE_ATTR, hf_model


def is_multimodal(hf) -> bool:
    """A model with a vision tower: its config has a `vision_config` sub-config."""
    subs = getattr(hf.config, "sub_configs", None) or {}
    return "vision_config" in subs and getattr(hf.config, "vision_config", None) is not None


def vision_config_keys(hf) -> tuple[str, ...]:
    """The top-level sub-configs that are not the language model's (vision, audio, projector
    towers): `patch()` leaves their attention implementation as it is."""
    if not is_multimodal(hf):
        return ()
    text = hf.config.get_text_config()
    return tuple(k for k in (hf.config.sub_configs or {}) if getattr(hf.config, k, None) is not None and getattr(hf.config, k) is not text)


def vision_family(hf) -> Any:
    """The adapter of `hf` (a PreTrainedModel) for batches with images, or None for a text-only
    model. Raises NotSupported for a refused or unclassified image-text-to-text model."""
    if not is_multimodal(hf):
        return None
    model_type = getattr(hf.config, "model_type", type(hf).__name__)
    status, detail = verdict(model_type, type(hf).__name__)
    if status != EXACT:
        raise NotSupported(
            f"{type(hf).__name__} ({model_type}) cannot train images under sequence parallelism: {detail}",
            "train it on text-only batches (shard_batch: the language model is patched as usual), or without sequence "
            "parallelism (ulysses_degree=ring_degree=1); docs/measured/models.md lists the exact families",
        )
    return detail


def vision_spec(model: Any):
    """The `VisionSpec` of a (patched or not) image-text-to-text model, for `shard_multimodal`
    and `MultimodalCollator` (which also take it from a patched model: `model=`).

    Args:
        model: An image-text-to-text model (or PEFT model), patched or not.

    Returns:
        (VisionSpec): Its spec; the one `patch()` remembered when the model is patched.

    Raises:
        NotSupported: A refused or unclassified family.
    """
    hf = hf_model(model)
    remembered = getattr(hf.__dict__.get(PATCH_STATE_ATTR), "vision_spec", None)
    if remembered is not None:
        return remembered
    family = vision_family(hf)
    if family is None:
        raise NotSupported(
            f"{type(hf).__name__} has no vision tower (no vision_config): it takes text-only batches",
            "use hf_longctx.shard_batch / LongContextCollator for text",
        )
    return family.spec(hf)
