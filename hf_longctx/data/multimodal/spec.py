"""What the data stage must know about a vision-language model: `VisionSpec`.

Where it sits: built once from the model by `integrations/vision/families.py` (which reads
the model's config and binds its own position function), then handed to the multimodal
collator and `shard_multimodal` (`data/multimodal/`). It holds plain values and one
callable, so the data floor never imports transformers: the placeholder token of each
modality, where its pixels and grids sit in a processor's output, how many language-model
tokens one image or video yields, the encoder's cost per item (patches, patches²: the
vision tower's attention is bidirectional within one image or one video frame), and the
model's own per-document position rule (M-RoPE `get_rope_index` for the Qwen-VL family;
None for 1-D positions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hf_longctx.data.cost import CostModel

GRID = "grid"  # pixel rows of every item concatenated ([Σ patches, C·T·P·P]), one (t, h, w) grid row per item
BATCH = "batch"  # one pixel tensor per item along dim 0 ([N, C, H, W]); every item yields the same token count


@dataclass(frozen=True)
class Modality:
    """One kind of visual input (image or video) of a model.

    name: the `mm_encoder_outputs` key ("image" / "video").
    token_id: its placeholder token (the processor expands one placeholder per feature row).
    pixel_key / grid_key: where a processor's output keeps its pixels and, for GRID layouts,
        its (t, h, w) grid rows; `item_keys`: other per-item tensors (dim 0 = items) that
        travel with each item (e.g. `second_per_grid_ts`).
    type_id: its value in `mm_token_type_ids` (transformers: 1 image, 2 video).
    """

    name: str
    token_id: int
    pixel_key: str
    grid_key: str | None = None
    item_keys: tuple[str, ...] = ()
    type_id: int = 1


@dataclass(frozen=True)
class VisionCost:
    """Encoder work of one encode unit (an image, or one temporal slice of a video) of `p`
    patches: a·p² + b·p, in FLOPs of forward + backward (3× forward) like `CostModel`.

    Args:
        a: The quadratic coefficient, 12·depth·hidden: bidirectional attention computes the
            whole p×p score matrix and its product with V (4·p²·hidden forward per block).
        b: The linear coefficient, 6·N_patch: the weights every patch multiplies (per block
            q, k, v, o and the MLP) plus the merger/projector.
    """

    a: float
    b: float

    def __call__(self, patches: int) -> float:
        return self.a * patches * patches + self.b * patches

    @classmethod
    def from_vision_config(cls, config: Any) -> "VisionCost":
        """The cost of a vision tower from its config's width, depth and MLP size (names vary per family)."""
        h = config_int(config, ("hidden_size", "embed_dim", "width"), 1024)
        depth = config_int(config, ("depth", "num_hidden_layers", "num_layers"), 24)
        inter = config_int(config, ("intermediate_size", "mlp_dim"), 4 * h)
        per_patch = depth * (4 * h * h + 2 * h * inter)
        return cls(a=12.0 * depth * h, b=6.0 * per_patch)


def config_int(config: Any, names: tuple[str, ...], default: int) -> int:
    """The first positive int among `config`'s attributes `names`, else `default` (vision configs
    name their sizes differently per family)."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return default


@dataclass(frozen=True)
class VisionSpec:
    """The data stage's view of one vision-language model (see the module docstring).

    `hf_longctx.vision_spec(model)` returns the spec of a supported family.

    Args:
        family: The adapter's name (for messages).
        modalities: The model's kinds of visual input (image, video), each a `Modality`.
        layout: GRID or BATCH.
        hidden: Width D of one feature row.
        cost: The encoder's work per encode unit (`VisionCost`).
        merge: GRID only: language-model tokens per item = t·h·w / merge² (spatial merge).
        tokens_per_item: BATCH only: tokens one item yields (fixed by the config).
        patches_per_item: BATCH only: encoder patches of one item (its cost).
        frames_separable: A GRID video item is encoded as its t temporal slices (the tower's
            attention and positions never cross a slice: checked by a contract test per
            family), so its frames can be dealt to different ranks.
        positions: `(ids [L], grids {modality name: [n, 3]}, extras {key: [n]}) -> [3, L]`
            for one DOCUMENT (the model's own M-RoPE rule), or None for 1-D positions
            restarting per document.
        text_row: The language model takes [4, B, S] position ids (text row first) rather
            than [3, B, S].
        deepstack: How many extra feature levels the encoder returns per token (Qwen3-VL
            DeepStack).
        container: How `mm_encoder_outputs[m].pooler_output` is laid out: "list" (one
            [T, D] tensor per item) or "tensor" ([items, T, D]); the models concatenate /
            flatten either.
        refused_keys: Batch keys whose non-zero values change the model in a way SP does not
            reproduce (Gemma 3's `token_type_ids`: bidirectional attention inside images),
            each with the message that names the fix.
        text_cost: The language model's per-document cost in the unit of `cost` (FLOPs),
            the multimodal collator's default.
        separators: Token ids that stand between documents and never inside one (the
            language model's BOS and padding token where they differ from its EOS): a row
            without boundaries that holds one between its content is several documents
            (`documents.check_one_document`).

    Raises:
        ValueError: An unknown layout or container, or a BATCH layout without
            `tokens_per_item` and `patches_per_item`.
    """

    family: str
    modalities: tuple[Modality, ...]
    layout: str
    hidden: int
    cost: VisionCost
    merge: int = 1
    tokens_per_item: int | None = None
    patches_per_item: int | None = None
    frames_separable: bool = False
    positions: Callable[..., torch.Tensor] | None = field(default=None, compare=False)
    text_row: bool = False
    deepstack: int = 0
    container: str = "list"
    refused_keys: tuple[tuple[str, str], ...] = ()  # (batch key, why it cannot be exact) when set to non-zeros
    text_cost: CostModel | None = None  # the language model's CostModel.from_config (FLOPs, the unit of `cost`)
    separators: tuple[int, ...] = ()  # BOS / padding ids of the language model (not its EOS)

    def __post_init__(self) -> None:
        if self.layout not in (GRID, BATCH):
            raise ValueError(f"VisionSpec.layout must be {GRID!r} or {BATCH!r}, got {self.layout!r}")
        if self.layout == BATCH and not (self.tokens_per_item and self.patches_per_item):
            raise ValueError(f"{self.family}: a {BATCH!r} layout needs tokens_per_item and patches_per_item")
        if self.container not in ("list", "tensor"):
            raise ValueError(f"VisionSpec.container must be 'list' or 'tensor', got {self.container!r}")

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The placeholder token ids of every modality (image, video) in the language model's input."""
        return tuple(m.token_id for m in self.modalities)

    @property
    def input_keys(self) -> frozenset[str]:
        """Every batch key the vision inputs occupy (consumed by `shard_multimodal`)."""
        keys = {"mm_token_type_ids"}
        for m in self.modalities:
            keys.add(m.pixel_key)
            keys.update(k for k in (m.grid_key, *m.item_keys) if k)
        return frozenset(keys)

    def item_tokens(self, grid: tuple[int, int, int] | None) -> int:
        """Language-model tokens of one item (a GRID item's (t, h, w) grid, or None)."""
        if self.layout == BATCH:
            return int(self.tokens_per_item)
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)

    def item_patches(self, grid: tuple[int, int, int] | None) -> int:
        """Encoder patches of one item (a GRID item's (t, h, w) grid, or None)."""
        return int(self.patches_per_item) if self.layout == BATCH else math.prod(grid)
