"""Per-family adapters: a vision-language model's `VisionSpec` and its encoder call.

Where it sits: `registry.py` picks the adapter for a model type; the data stage gets its
`VisionSpec`, the vision hook (`forward.py`) its `encode`. Each adapter follows the family's
transformers API, pinned by a CPU contract test (tests/unit/test_vision_contracts.py).
`GridFamily` (Qwen2-VL ... Qwen3.5): patch rows with a (t, h, w) grid per item, t·h·w / merge²
tokens, per-item [T_i, D] features (+ DeepStack levels); the tower attends within a temporal
slice, so encoding items and slices apart equals encoding them together; positions from the
model's `get_rope_index` per document. `BatchFamily` (Gemma 3, LLaVA): one [C, H, W] image
per item, a fixed token count, each image encoded independently."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from hf_longctx.data.cost import CostModel
from hf_longctx.data.multimodal.spec import BATCH, GRID, Modality, VisionCost, VisionSpec


def _base(hf) -> Any:
    """The inner `*Model` holding `get_rope_index` (the ForConditionalGeneration wraps it)."""
    for m in (hf, getattr(hf, "model", None)):
        if m is not None and callable(getattr(m, "get_rope_index", None)):
            return m
    return getattr(hf, "model", hf)


def _hidden(hf) -> int:
    text = hf.config.get_text_config()
    return int(text.hidden_size)


def _ids(value: Any) -> set[int]:
    """A config's token id entry (an int, a list of ints, or None) as a set."""
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else set()


def separators(hf) -> tuple[int, ...]:
    """The language model's BOS and padding ids (text config first, then the top config), less
    its EOS ids: a tokenizer that prepends BOS starts every document with it, and Qwen's
    `<|endoftext|>` (its configs' BOS) ends each packed pretraining document, while EOS also
    closes every chat turn inside one document."""
    text, top = hf.config.get_text_config(), hf.config
    pick = lambda name: _ids(getattr(text, name, None)) or _ids(getattr(top, name, None))  # noqa: E731
    return tuple(sorted((pick("bos_token_id") | pick("pad_token_id")) - pick("eos_token_id")))


@dataclass(frozen=True)
class GridFamily:
    """Qwen-VL-style adapter (see the module docstring). `frames`: a video's temporal
    slices are encoded independently by this family's tower (contract-tested)."""

    name: str
    frames: bool = True

    def spec(self, hf) -> VisionSpec:
        cfg, vcfg = hf.config, hf.config.vision_config
        base = _base(hf)
        has_rope = callable(getattr(base, "get_rope_index", None))  # M-RoPE; else 1-D positions
        rope = inspect.signature(base.get_rope_index).parameters if has_rope else {}
        missing = [k for k in ("input_ids", "mm_token_type_ids", "image_grid_thw", "video_grid_thw") if has_rope and k not in rope]
        if missing:
            raise ValueError(f"{type(base).__name__}.get_rope_index takes no {missing}: not the Qwen-VL position contract")
        video_keys = ("second_per_grid_ts",) if "second_per_grid_ts" in rope else ()
        modalities = [Modality("image", int(cfg.image_token_id), "pixel_values", "image_grid_thw", (), 1)]
        if getattr(cfg, "video_token_id", None) is not None and callable(getattr(hf, "get_video_features", None)):
            modalities.append(Modality("video", int(cfg.video_token_id), "pixel_values_videos", "video_grid_thw", video_keys, 2))

        def positions(ids: torch.Tensor, grids: dict, extras: dict) -> torch.Tensor:
            types = torch.zeros_like(ids)
            for m in modalities:
                types[ids == m.token_id] = m.type_id
            kw = dict(input_ids=ids[None], mm_token_type_ids=types[None],
                      image_grid_thw=grids.get("image"), video_grid_thw=grids.get("video"))
            if "second_per_grid_ts" in extras:
                kw["second_per_grid_ts"] = extras["second_per_grid_ts"]
            pos, _ = base.get_rope_index(**kw)  # [3, 1, L]
            return pos[:, 0]

        depth = getattr(vcfg, "depth", None) or getattr(vcfg, "num_hidden_layers", None) or 0
        levels = [i for i in (getattr(vcfg, "deepstack_visual_indexes", None) or ()) if i < depth]  # the blocks that exist
        return VisionSpec(
            family=self.name, modalities=tuple(modalities), layout=GRID, hidden=_hidden(hf),
            cost=VisionCost.from_vision_config(vcfg), merge=int(vcfg.spatial_merge_size), frames_separable=self.frames,
            positions=positions if has_rope else None, text_row=has_rope, deepstack=len(levels), container="list",
            text_cost=CostModel.from_config(cfg), separators=separators(hf),
        )

    def encode(self, hf, modality: Modality, inputs: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """([n, D] rows of this rank's units, in unit order; DeepStack levels, each [n, D])."""
        fn = hf.get_video_features if modality.name == "video" else hf.get_image_features
        out = fn(inputs["pixels"], inputs["grid"])
        rows = torch.cat(list(out.pooler_output))  # [n, D]: one [T_i, D] per unit
        deep = [torch.cat(list(level)) for level in (getattr(out, "deepstack_features", None) or [])]
        return rows, deep


def _patches(vcfg) -> int:
    return (int(vcfg.image_size) // int(vcfg.patch_size)) ** 2


@dataclass(frozen=True)
class BatchFamily:
    """One image per item along dim 0, a fixed token count (Gemma 3, LLaVA)."""

    name: str

    def _tokens(self, hf) -> int:
        cfg = hf.config
        if self.name == "gemma3":
            return int(cfg.mm_tokens_per_image)
        # LLaVA: the vision tower's patches, its CLS token (CLIP) kept only by the "full" strategy
        vcfg = cfg.vision_config
        cls_token = 1 if "clip" in str(getattr(vcfg, "model_type", "")) else 0
        drop = 1 if cfg.vision_feature_select_strategy == "default" else 0
        return _patches(vcfg) + cls_token - drop

    def spec(self, hf) -> VisionSpec:
        cfg = hf.config
        refused = ()
        if self.name == "gemma3":
            refused = ((
                "token_type_ids",
                "Gemma 3 attends bidirectionally inside each image when token_type_ids mark its tokens, and the "
                "sequence-parallel attention here is causal, so the result would differ from one device; drop "
                "'token_type_ids' from the batch (causal attention over image tokens, as transformers runs Gemma 3 "
                "without them)",
            ),)
        return VisionSpec(
            family=self.name, modalities=(Modality("image", int(cfg.image_token_id), "pixel_values"),), layout=BATCH,
            hidden=_hidden(hf), cost=VisionCost.from_vision_config(cfg.vision_config),
            tokens_per_item=self._tokens(hf), patches_per_item=_patches(cfg.vision_config),
            container="tensor" if self.name == "gemma3" else "list", refused_keys=refused,
            text_cost=CostModel.from_config(cfg), separators=separators(hf),
        )

    def encode(self, hf, modality: Modality, inputs: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
        out = hf.get_image_features(pixel_values=inputs["pixels"])
        feats = out.pooler_output
        rows = feats.reshape(-1, feats.shape[-1]) if isinstance(feats, torch.Tensor) else torch.cat(list(feats))  # [n·T, D]
        return rows, []
