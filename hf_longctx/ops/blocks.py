"""Block planning: which (query run × key run) tiles of a local attention are computed.

Where it sits: `ops/kernels.py` turns the runs of the local query and key tokens
(`hf_longctx/layout.py`) into tiles with `plan_blocks`; ring attention and FPDT call it once
per key block, so skipping tiles no query may see is what makes the zigzag layout (USP
Algorithm 2) and FPDT's causal chunk schedule (§3.3) pay off.
Rule (i, j global positions): i attends j iff same document AND (not causal or j <= i) AND
(no window, or |i - j| < window on the allowed side), as in transformers' sliding window.
Kinds: "full" (no mask), "causal" (square, identical global ranges: the kernel's own flag
is exact), "masked" (an explicit boolean mask from `block_mask`). Pure Python over runs."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from hf_longctx.layout import Run


class Block(NamedTuple):
    """Local rows [q_lo, q_hi) of q against local rows [k_lo, k_hi) of k; q_start and
    k_start are the global positions of row q_lo and of row k_lo."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    kind: str
    q_start: int
    k_start: int


def _check_window(window: int | None) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be None or an int >= 1, got {window!r}")


def _key_range(i: int, causal: bool, window: int | None) -> tuple[float, float]:
    """Inclusive range of global key positions query i may attend (same document)."""
    if causal:
        lo = -float("inf") if window is None else i - window + 1
        return lo, i
    if window is None:
        return -float("inf"), float("inf")
    return i - window + 1, i + window - 1


def _allowed_in_row(i: int, k0: int, nk: int, causal: bool, window: int | None) -> int:
    lo, hi = _key_range(i, causal, window)
    return max(0, int(min(hi, k0 + nk - 1) - max(lo, k0) + 1))


def _classify(q0: int, nq: int, k0: int, nk: int, causal: bool, window: int | None) -> str | None:
    """Kind of the tile of global rows [q0, q0+nq) × cols [k0, k0+nk) of one document,
    or None when no pair is allowed. Uses the extreme differences i - j over the tile."""
    d_max = (q0 + nq - 1) - k0  # largest i - j
    d_min = q0 - (k0 + nk - 1)  # smallest i - j
    if causal:
        if d_max < 0 or (window is not None and d_min >= window):
            return None
        if d_min >= 0 and (window is None or d_max < window):
            return "full"
        if q0 == k0 and nq == nk and (window is None or nq - 1 < window):
            return "causal"
        return "masked"
    if window is None:
        return "full"
    if d_min >= window or -d_max >= window:
        return None
    if max(d_max, -d_min) < window:
        return "full"
    return "masked"


class Tiles(list):
    """The tiles of one planned (q runs x k runs) pair, kept by a plan for the whole micro-batch
    (`ops/ring.RingPlan`, `ops/fpdt_schedule.FPDTPlan`), with a `memo` where a backend keeps what it
    derives from them once (`ops/backends/packed.py`: the device index tensors and
    cumulative lengths), so that no layer rebuilds or re-uploads them. A list: compares
    equal to the plain list of the same blocks."""

    def __init__(self, blocks=()):
        super().__init__(blocks)
        self.memo: dict = {}


def plan_blocks(q_runs: Sequence[Run], k_runs: Sequence[Run], *, causal: bool, window: int | None) -> list[Block]:
    """Every (q run × k run) tile of the same document that holds an allowed pair,
    with its exact kind, in q-run-major order. With a window, runs are first cut into
    window-aligned pieces so that no tile (and no mask) exceeds window × window."""
    _check_window(window)
    for name, runs in (("q_runs", q_runs), ("k_runs", k_runs)):
        bad = [r for r in runs if r.length < 0 or r.start < 0]
        if bad:
            raise ValueError(f"{name} holds runs with negative start or length: {bad[:4]}")
    if window is not None:
        return _plan_windowed(q_runs, k_runs, causal=causal, window=window)
    # Key runs grouped by document (in local order): a query run only meets its own
    # document's runs, so planning is linear in the runs, not quadratic -- it runs on every
    # attention call of every layer, and packed batches hold hundreds of documents.
    by_doc: dict[int, list[tuple[Run, int]]] = {}
    for piece, k_lo in _with_offsets(k_runs):
        by_doc.setdefault(piece.doc, []).append((piece, k_lo))
    blocks = []
    for qr, q_lo in _with_offsets(q_runs):
        for kr, k_lo in by_doc.get(qr.doc, ()):
            if qr.length == 0 or kr.length == 0:
                continue
            kind = _classify(qr.start, qr.length, kr.start, kr.length, causal, window)
            if kind is not None:
                blocks.append(Block(q_lo, q_lo + qr.length, k_lo, k_lo + kr.length, kind, qr.start, kr.start))
    return blocks


def _with_offsets(runs: Sequence[Run]) -> list[tuple[Run, int]]:
    """Each run with the local offset of its first token."""
    out, off = [], 0
    for r in runs:
        out.append((r, off))
        off += r.length
    return out


def _grid_pieces(runs: Sequence[Run], window: int) -> list[tuple[Run, int]]:
    """Runs cut at global multiples of `window`, each piece with its local offset. Every
    run is cut on the same grid, so the row ranges of all tiles are equal or disjoint."""
    out = []
    for r, off in _with_offsets(runs):
        pos = r.start
        while pos < r.start + r.length:
            end = min(r.start + r.length, (pos // window + 1) * window)
            out.append((Run(r.doc, pos, end - pos), off + pos - r.start))
            pos = end
    return out


def _plan_windowed(q_runs: Sequence[Run], k_runs: Sequence[Run], *, causal: bool, window: int) -> list[Block]:
    """Sliding-window plan with tiles of at most window x window: a query piece in grid cell
    A can only see keys in cells A-1 and A (and A+1 without causality), so a long document
    costs O(S·window) work and no mask larger than window x window is ever built."""
    cells: dict[tuple[int, int], list[tuple[Run, int]]] = {}
    for piece, k_lo in _grid_pieces(k_runs, window):
        cells.setdefault((piece.doc, piece.start // window), []).append((piece, k_lo))
    reach = (-1, 0) if causal else (-1, 0, 1)
    blocks = []
    for qr, q_lo in _grid_pieces(q_runs, window):
        cell = qr.start // window
        for dc in reach:
            for kr, k_lo in cells.get((qr.doc, cell + dc), ()):
                kind = _classify(qr.start, qr.length, kr.start, kr.length, causal, window)
                if kind is not None:
                    blocks.append(Block(q_lo, q_lo + qr.length, k_lo, k_lo + kr.length, kind, qr.start, kr.start))
    return blocks


def score_count(blocks: Sequence[Block], *, causal: bool, window: int | None) -> int:
    """Number of (i, j) score elements the plan computes that are allowed
    (full: nq·nk; causal: n(n+1)/2; masked: its allowed pairs)."""
    total = 0
    for b in blocks:
        nq, nk = b.q_hi - b.q_lo, b.k_hi - b.k_lo
        if b.kind == "full":
            total += nq * nk
        elif b.kind == "causal":
            total += nq * (nq + 1) // 2
        elif b.kind == "masked":
            total += sum(_allowed_in_row(b.q_start + r, b.k_start, nk, causal, window) for r in range(nq))
        else:
            raise ValueError(f"unknown block kind {b.kind!r} in {b}")
    return total


def block_mask(block: Block, *, causal: bool, window: int | None, device: torch.device | str | None = None) -> torch.Tensor:
    """bool [nq, nk], True = attend, for one tile of a single document."""
    _check_window(window)
    nq, nk = block.q_hi - block.q_lo, block.k_hi - block.k_lo
    qpos = torch.arange(block.q_start, block.q_start + nq, device=device)[:, None]  # [nq, 1]
    kpos = torch.arange(block.k_start, block.k_start + nk, device=device)[None, :]  # [1, nk]
    # Bool comparisons straight to [nq, nk]: no int64 difference matrix.
    if causal:
        allowed = kpos <= qpos
        if window is not None:
            allowed &= kpos > qpos - window
    elif window is not None:
        allowed = (kpos > qpos - window) & (kpos < qpos + window)
    else:
        allowed = torch.ones(nq, nk, dtype=torch.bool, device=device)
    return allowed
