"""What `patch()` does differently for an image-text-to-text model.

Where it sits: `integrations/model_patch.patch` asks `vision_binding(hf)` once, before it
changes anything. A text-only model gets one implementation name for every config and no
hook. A model with a vision tower gets `implementation(name)` ({"": name, "text_config":
name}: the language model runs sequence-parallel attention, every non-text tower keeps its
own, and `keep_ids` names those configs for the checks) and `hook`: the vision hook of
`forward.py` for an EXACT family, or a guard that refuses pixel inputs naming the cause
(text-only batches of such a model still train)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from hf_longctx.errors import NotSupported
from hf_longctx.integrations.patch_state import PatchState
from hf_longctx.integrations.vision.registry import vision_config_keys, vision_family


@dataclass(frozen=True)
class VisionBinding:
    family: Any = None
    spec: Any = None
    text_key: str | None = None
    keep_ids: frozenset = frozenset()
    refusal: NotSupported | None = field(default=None, compare=False)
    pixel_keys: tuple[str, ...] = ()

    def implementation(self, name: str):
        if not self.keep_ids:
            return name
        return {"": name, self.text_key: name} if self.text_key else {"": name}

    def make_hook(self, state: PatchState, hf) -> Callable | None:
        """The forward pre-hook for `hf` under `state` (the patch), or None for a text-only model."""
        if self.family is not None:
            from hf_longctx.integrations.vision.forward import make_vision_hook

            return make_vision_hook(state, hf, self.family, self.spec)
        if self.refusal is not None:
            return _guard(self.refusal, self.pixel_keys)
        return None


def _guard(refusal: NotSupported, keys: tuple[str, ...]) -> Callable:
    def hook(module, args, kwargs):
        if any(kwargs.get(k) is not None for k in keys):
            raise refusal
        return args, kwargs

    return hook


def _subtree(cfg) -> list:
    out, todo = [], [cfg]
    while todo:
        c = todo.pop()
        if c is None or any(c is o for o in out):
            continue
        out.append(c)
        todo.extend(getattr(c, k, None) for k in (getattr(c, "sub_configs", None) or {}))
    return out


def vision_binding(hf) -> VisionBinding:
    """The binding of `hf` (a PreTrainedModel); see the module docstring."""
    keys = vision_config_keys(hf)
    if not keys:
        return VisionBinding()
    text = hf.config.get_text_config()
    text_key = next((k for k in (hf.config.sub_configs or {}) if getattr(hf.config, k, None) is text), None)
    keep = frozenset(id(c) for k in keys for c in _subtree(getattr(hf.config, k)) if c is not text)
    pixel_keys = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "mm_encoder_outputs")
    try:
        family = vision_family(hf)
    except NotSupported as refusal:
        return VisionBinding(text_key=text_key, keep_ids=keep, refusal=refusal, pixel_keys=pixel_keys)
    return VisionBinding(family=family, spec=family.spec(hf), text_key=text_key, keep_ids=keep)
