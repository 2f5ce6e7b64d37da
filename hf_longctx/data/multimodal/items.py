"""The visual items of one packed row, checked against its placeholder tokens.

Where it sits: `shard_multimodal` (and the multimodal collator, per document) call
`read_row` on the processor's tensors before any collective. It pairs every image and video
of the row with the run of placeholder tokens it fills -- transformers' contract: feature
row i of a modality fills that modality's i-th placeholder in (batch, sequence) order -- and
cuts the row's encoder work into encode units: an image, or one temporal slice of a video
when the family's tower never mixes slices (`VisionSpec.frames_separable`). A batch whose
placeholder count disagrees with its pixels or grids, a video without its grid, an item
whose tokens straddle two documents: a ValueError naming the values and the fix. Nothing is
dropped or truncated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from hf_longctx.data.multimodal.spec import BATCH, VisionSpec


@dataclass(frozen=True)
class Unit:
    """One call's worth of encoder input: an image, or one temporal slice of a video.

    modality: index into `spec.modalities`; item: the item's ordinal within its modality;
    pixels: rows [a, b) of the modality's pixel tensor (GRID: patch rows; BATCH: items);
    grid: the unit's own (t, h, w) (GRID) or None; tokens: ordinals [a, b) of the placeholders
    it fills among its modality's; patches: encoder patches (its cost)."""

    modality: int
    item: int
    pixels: tuple[int, int]
    grid: tuple[int, int, int] | None
    tokens: tuple[int, int]
    patches: int

    @property
    def n_tokens(self) -> int:
        return self.tokens[1] - self.tokens[0]


@dataclass(frozen=True)
class RowVision:
    """The visual content of one row: `units` in (modality, item, frame) order -- the order of
    the encoder's output rows -- and, per modality, the source positions of its placeholders
    ([n_m] int64), the (document, grid) of each item, and its per-item extras."""

    units: tuple[Unit, ...]
    placeholders: tuple[torch.Tensor, ...]
    items: tuple[tuple[tuple[int, tuple[int, int, int] | None], ...], ...]
    pixels: tuple[torch.Tensor | None, ...]
    extras: tuple[dict[str, torch.Tensor], ...]

    @property
    def empty(self) -> bool:
        return not self.units


def _grid_rows(name: str, value: Any) -> torch.Tensor:
    g = torch.as_tensor(value)
    if g.dim() == 1 and g.numel() == 3:
        g = g[None]
    if g.dim() != 2 or g.shape[1] != 3 or g.dtype.is_floating_point:
        raise ValueError(f"batch['{name}'] must be an integer [n, 3] tensor of (t, h, w) rows, got shape {tuple(g.shape)}")
    if bool((g <= 0).any()):
        raise ValueError(f"batch['{name}'] has a non-positive (t, h, w) entry: {g.tolist()[:4]}")
    return g.long()


def _document_of(pos: int, cu: Sequence[int]) -> int:
    lo, hi = 0, len(cu) - 1
    while hi - lo > 1:  # cu[lo] <= pos < cu[hi]
        mid = (lo + hi) // 2
        if cu[mid] <= pos:
            lo = mid
        else:
            hi = mid
    return lo


def read_row(batch: Mapping[str, Any], ids: torch.Tensor, cu: Sequence[int], spec: VisionSpec) -> RowVision:
    """The items of the packed row `ids` [S] (documents at boundaries `cu`) from `batch`'s
    pixel / grid tensors; raises ValueError on any disagreement (see the module docstring)."""
    units: list[Unit] = []
    placeholders, items, pixels, extras = [], [], [], []
    for mi, m in enumerate(spec.modalities):
        where = (ids == m.token_id).nonzero().flatten()  # [n_m] source positions of the placeholders
        placeholders.append(where)
        pix = batch.get(m.pixel_key)
        grid = batch.get(m.grid_key) if m.grid_key else None
        if pix is None:
            if len(where):
                raise ValueError(
                    f"the batch has {len(where)} {m.name} placeholder tokens (id {m.token_id}) but no '{m.pixel_key}'; pass "
                    f"the processor's '{m.pixel_key}'{' and ' + repr(m.grid_key) if m.grid_key else ''} with the input_ids, "
                    f"or drop the {m.name} tokens"
                )
            if grid is not None and torch.as_tensor(grid).numel():
                raise ValueError(f"the batch has '{m.grid_key}' but no '{m.pixel_key}': pass both, or neither")
            items.append(())
            pixels.append(None)
            extras.append({})
            continue
        pix = pix if isinstance(pix, torch.Tensor) else torch.as_tensor(pix)
        if spec.layout == BATCH:
            n_items = pix.shape[0]
            grids: list = [None] * n_items
            sizes = [1] * n_items
        else:
            if grid is None:
                raise ValueError(
                    f"'{m.pixel_key}' ({tuple(pix.shape)}) came without '{m.grid_key}': a {m.name} without its (t, h, w) "
                    f"grid cannot be split into items nor given positions; pass the processor's '{m.grid_key}' too"
                )
            g = _grid_rows(m.grid_key, grid)
            bad = [tuple(r) for r in g.tolist() if r[1] % spec.merge or r[2] % spec.merge]
            if bad:
                raise ValueError(f"'{m.grid_key}' rows {bad[:4]} have h or w not divisible by the spatial merge {spec.merge}")
            grids = [tuple(int(x) for x in r) for r in g.tolist()]
            sizes = [t * h * w for t, h, w in grids]
            if pix.dim() != 2 or pix.shape[0] != sum(sizes):
                raise ValueError(
                    f"'{m.pixel_key}' has shape {tuple(pix.shape)} but '{m.grid_key}' {g.tolist()[:4]}"
                    f"{'...' if len(g) > 4 else ''} describes {sum(sizes)} patch rows; pass the two tensors the processor "
                    "returned together, for the same images and in the same order"
                )
        tokens = [spec.item_tokens(gr) for gr in grids]
        if sum(tokens) != len(where):
            raise ValueError(
                f"the batch has {len(where)} {m.name} placeholder tokens (id {m.token_id}) but its {len(grids)} "
                f"{m.name}(s) yield {sum(tokens)} tokens ({tokens[:8]}{'...' if len(tokens) > 8 else ''}); the input_ids "
                f"and '{m.pixel_key}' must come from the same processor call (a truncated text cuts {m.name} tokens: "
                "truncate before the processor expands them, or drop the sample)"
            )
        extra = {}
        for key in m.item_keys:
            if batch.get(key) is not None:
                value = torch.as_tensor(batch[key])
                if value.shape[0] != len(grids):
                    raise ValueError(f"batch['{key}'] has {value.shape[0]} entries for {len(grids)} {m.name}(s)")
                extra[key] = value
        row_items, start_tok, start_pix = [], 0, 0
        for k, (gr, n_tok, size) in enumerate(zip(grids, tokens, sizes)):
            first, last = int(where[start_tok]), int(where[start_tok + n_tok - 1])
            doc = _document_of(first, cu)
            if _document_of(last, cu) != doc:
                raise ValueError(
                    f"{m.name} {k}'s {n_tok} tokens run from position {first} to {last}, across the document boundary "
                    f"{cu[doc + 1]}: an image belongs to one document; check the packing (cu_seq_lens / position_ids)"
                )
            row_items.append((doc, gr))
            units.extend(_units(spec, mi, k, gr, start_pix, size, start_tok, n_tok))
            start_tok += n_tok
            start_pix += size
        items.append(tuple(row_items))
        pixels.append(pix)
        extras.append(extra)
    return RowVision(tuple(units), tuple(placeholders), tuple(items), tuple(pixels), tuple(extras))


def _units(spec: VisionSpec, mi: int, k: int, grid, start_pix: int, size: int, start_tok: int, n_tok: int) -> list[Unit]:
    if spec.layout == BATCH:
        return [Unit(mi, k, (start_pix, start_pix + 1), None, (start_tok, start_tok + n_tok), int(spec.patches_per_item))]
    t, h, w = grid
    if t == 1 or not spec.frames_separable:
        return [Unit(mi, k, (start_pix, start_pix + size), grid, (start_tok, start_tok + n_tok), size)]
    per_pix, per_tok = h * w, n_tok // t  # the processor orders a video's patches and tokens slice by slice
    return [
        Unit(mi, k, (start_pix + f * per_pix, start_pix + (f + 1) * per_pix), (1, h, w),
             (start_tok + f * per_tok, start_tok + (f + 1) * per_tok), per_pix)
        for f in range(t)
    ]
