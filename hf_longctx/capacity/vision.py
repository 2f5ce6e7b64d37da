"""What a vision tower adds to a plan: its parameters, its share of the images, the embedding exchange.

Where it sits: `hf-longctx plan --images N --image-tokens T` (or `--video-seconds S --fps F
--frame-tokens T`) builds a `VisionBudget`; `capacity/search.rank_settings` charges every
setting with `.charge` (memory) and `.seconds` (step time). The terms follow the code
(`integrations/vision/`): tower and projector are ZeRO-3 parameters in FSDP's root unit
(gathered whole, unsharded gradients at once); each rank encodes at most 1/sp of the work
plus one unit (the LPT deal), with `depth` bidirectional blocks of activations; the
embedding exchange's buffers and time at the group's bandwidth. Image tokens are part of
the sequence (the micro-batch's tokens count them)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from hf_longctx.data.multimodal.spec import VisionCost
from hf_longctx.data.multimodal.spec import config_int as _int


@dataclass(frozen=True)
class VisionDims:
    """Sizes of the vision tower read from `config.vision_config`."""

    hidden: int
    depth: int
    intermediate: int
    merge: int  # spatial merge: patches per language-model token = merge²
    out: int  # width of the rows sent to the language model
    deepstack: int
    params: int

    @classmethod
    def from_config(cls, config: Any) -> "VisionDims":
        v = getattr(config, "vision_config", None)
        if v is None:
            raise ValueError(f"{type(config).__name__} has no vision_config: --images / --video-seconds need a vision-language model")
        h = _int(v, ("hidden_size", "embed_dim"), 1024)
        depth = _int(v, ("depth", "num_hidden_layers", "num_layers"), 24)
        inter = _int(v, ("intermediate_size",), 4 * h)
        merge = _int(v, ("spatial_merge_size",), 1)
        text = config.get_text_config()
        out = _int(v, ("out_hidden_size",), text.hidden_size)
        patch = _int(v, ("patch_size",), 14)
        chans = _int(v, ("in_channels", "num_channels"), 3) * _int(v, ("temporal_patch_size",), 1)
        per_block = 4 * h * h + 3 * h * inter + 4 * h  # attention, gated MLP, norms
        merger = (h * merge * merge) ** 2 + h * merge * merge * out
        levels = len(getattr(v, "deepstack_visual_indexes", None) or ())
        params = depth * per_block + chans * patch * patch * h + merger * (1 + levels)
        return cls(h, depth, inter, merge, out, levels, params)


@dataclass(frozen=True)
class VisionBudget:
    """Visual content per sample (document): `images` of `image_tokens` language-model tokens
    each, and/or `video_seconds` of video sampled at `fps`, `frame_tokens` tokens per temporal
    slice (two frames: the temporal patch)."""

    dims: VisionDims
    images: int = 0
    image_tokens: int = 0
    video_seconds: float = 0.0
    fps: float = 0.0
    frame_tokens: int = 0

    def __post_init__(self) -> None:
        if self.images and self.image_tokens < 1:
            raise ValueError(f"--images {self.images} needs --image-tokens (language-model tokens per image), got {self.image_tokens}")
        if self.video_seconds and (self.fps <= 0 or self.frame_tokens < 1):
            raise ValueError(f"--video-seconds {self.video_seconds} needs --fps > 0 and --frame-tokens >= 1, got "
                             f"{self.fps} and {self.frame_tokens}")

    @property
    def slices(self) -> int:
        """Temporal slices of the video (two frames each)."""
        return math.ceil(self.video_seconds * self.fps / 2) if self.video_seconds else 0

    @property
    def tokens(self) -> int:
        """Language-model tokens of one sample's visual content."""
        return self.images * self.image_tokens + self.slices * self.frame_tokens

    def units(self) -> list[int]:
        """Encoder patches of every encode unit of one sample (an image, or one video slice)."""
        m2 = self.dims.merge ** 2
        return [self.image_tokens * m2] * self.images + [self.frame_tokens * m2] * self.slices

    def per_rank(self, samples: float, sp: int) -> tuple[float, float]:
        """(encoder patches on the busiest rank, image tokens held per rank) for `samples` per micro-batch."""
        units = self.units()
        total = samples * sum(units)
        return total / sp + (max(units) if units else 0), samples * self.tokens / sp

    def charge(self, mem: Any, *, sp: int, world: int, samples: float, dt: int, optimizer: str) -> Any:
        """`mem` (a MemoryEstimate) with the tower's bytes added per GPU."""
        d = self.dims
        p = d.params
        master, grads = 4 * p / world, 4 * p / world
        optim = 8 * p / world if optimizer == "adamw" else 0.0
        gathered = dt * p if world > 1 else 0.0  # the root unit: the whole tower for the micro-batch
        patches, tokens = self.per_rank(samples, sp)
        per_patch = dt * (8 * d.hidden + 3 * d.intermediate)  # q, k, v, attention out, norms, MLP inputs per block
        acts = d.depth * patches * per_patch + patches * dt * d.hidden * d.merge ** 2  # + the merger's input
        exchange = 2 * tokens * dt * d.out * (1 + d.deepstack)  # send and receive rows
        return replace(mem, params=mem.params + master + gathered, grads=mem.grads + grads + (dt * p if world > 1 else 0.0),
                       optimizer=mem.optimizer + optim, activations=mem.activations + acts,
                       buffers=mem.buffers + exchange)

    def seconds(self, cost: VisionCost, *, sp: int, samples: float, rate: float, bandwidth: float, dt: int) -> float:
        """The busiest rank's encoder time and the exchange (forward and backward) of one micro-batch."""
        units = self.units()
        work = samples * sum(cost(u) for u in units) / sp + (max(cost(u) for u in units) if units else 0.0)
        _, tokens = self.per_rank(samples, sp)
        moved = 2 * tokens * dt * self.dims.out * (1 + self.dims.deepstack) * (sp - 1) / sp
        return work / rate + (moved / bandwidth if sp > 1 else 0.0)


def vision_budget(config: Any, *, images: int = 0, image_tokens: int = 0, video_seconds: float = 0.0, fps: float = 0.0,
                  frame_tokens: int = 0) -> VisionBudget | None:
    """The budget of the plan's flags, or None when no visual content was asked for."""
    if not (images or video_seconds):
        return None
    return VisionBudget(VisionDims.from_config(config), images, image_tokens, video_seconds, fps, frame_tokens)


def vision_cost(config: Any) -> VisionCost:
    return VisionCost.from_vision_config(config.vision_config)
