"""Walking the mask function transformers composes for each attention mask.

Where it sits: the dry run (`dry_run.probe_model`) collects the mask functions HF builds and
walks them here; `integrations/attention.py` reads a mask's sliding windows with
`mask_windows`. Only causal, packed-document, all-ones padding and sliding-window pieces
are what our attention applies; any other piece (chunked, blockwise, bidirectional,
custom, offsets) is named for the refusal.
"""

from __future__ import annotations

from typing import Callable

import torch


def mask_pieces(fn: Callable, windows: set, bad: set, depth: int = 0) -> None:
    """Walk the closures of one HF mask function; allow only what our attention applies."""
    name = getattr(fn, "__qualname__", repr(fn))
    cells = dict(zip(getattr(getattr(fn, "__code__", None), "co_freevars", ()), (c.cell_contents for c in (getattr(fn, "__closure__", None) or ()))))
    if depth > 16:
        bad.add(name)
    elif name == "causal_mask_function" or name.startswith("packed_sequence_mask_function."):
        pass
    elif name.startswith("and_masks."):
        for f in cells.get("mask_functions", ()):
            mask_pieces(f, windows, bad, depth + 1)
    elif name.startswith(("remap_positions_for_packed_sequence.", "add_offsets_to_mask_function.")):
        if cells.get("q_offset", 0) or cells.get("kv_offset", 0):
            bad.add(f"{name} with offsets ({cells.get('q_offset')}, {cells.get('kv_offset')})")
        mask_pieces(cells.get("mask_function"), windows, bad, depth + 1)
    elif name.startswith("sliding_window_overlay."):
        windows.add(int(cells["sliding_window"]))
    elif name.startswith("padding_mask_function."):
        pad = cells.get("padding_mask")
        if isinstance(pad, torch.Tensor) and not bool(pad.all()):
            bad.add("a padding mask with zeros")
    elif name.startswith("or_masks."):
        extra = [f for f in cells.get("mask_functions", ()) if getattr(f, "__qualname__", "") != "causal_mask_function"]
        for f in extra:
            bad.add(f"or-ed {getattr(f, '__qualname__', repr(f))} (keys beyond the causal document mask)")
    else:
        bad.add(name)


def mask_windows(fn: Callable) -> set:
    """The sliding windows of one HF mask function (its sliding_window_overlay pieces)."""
    windows: set = set()
    mask_pieces(fn, windows, set())
    return windows
