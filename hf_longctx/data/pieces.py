"""The planner's inputs: document lengths checked, and documents longer than one
micro-batch's cap refused, truncated or split into pieces (`overlong`).

Where it sits: first step of `packing.plan_microbatches` and of the flexible planners
(`flex/packing.py`, `flex/unequal.py`, `flex/collator.py`): every planner reads lengths
and makes pieces by this one rule.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hf_longctx.data.plan import Piece

OVERLONG = ("error", "truncate", "split")


def as_lengths(lengths: Any, hint: str = "") -> np.ndarray:
    """int64 [N] document lengths, every one >= 1; integral floats accepted; `hint` ends the
    error for empty documents (the step sampler names the usual cause)."""
    arr = np.asarray(lengths.tolist() if hasattr(lengths, "tolist") else list(lengths))
    if arr.ndim != 1:
        raise ValueError(f"lengths must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind == "f":
        bad = np.flatnonzero(arr != np.floor(arr))
        if bad.size:
            raise ValueError(f"lengths must be integers: document {bad[0]} has length {arr[bad[0]].item()!r}")
    elif arr.dtype.kind not in "iu":
        raise ValueError(f"lengths must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero(arr < 1)
    if bad.size:
        shown = ", ".join(f"document {i} has length {arr[i]}" for i in bad[:8])
        raise ValueError(f"every document needs at least 1 token: {shown}{' ...' if bad.size > 8 else ''}{hint}")
    return arr


def check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def make_pieces(lengths: np.ndarray, piece_max: int, overlong: str, cap_desc: str) -> list[Piece]:
    over = np.flatnonzero(lengths > piece_max)
    if over.size and overlong == "error":
        shown = ", ".join(f"document {i} has {lengths[i]} tokens" for i in over[:8])
        raise ValueError(
            f"{over.size} document(s) longer than the {piece_max}-token limit of one micro-batch "
            f"({cap_desc}): {shown}{' ...' if over.size > 8 else ''}; "
            'pass overlong="truncate" or overlong="split", or raise max_tokens'
        )
    if not over.size:
        return [Piece(i, 0, int(n)) for i, n in enumerate(lengths.tolist())]
    pieces = []
    for i, n in enumerate(lengths.tolist()):
        if n <= piece_max:
            pieces.append(Piece(i, 0, n))
        elif overlong == "truncate":
            pieces.append(Piece(i, 0, piece_max))
        else:
            pieces.extend(Piece(i, s, min(s + piece_max, n)) for s in range(0, n, piece_max))
    return pieces
