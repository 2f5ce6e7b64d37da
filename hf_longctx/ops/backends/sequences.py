"""From planned tiles to the variable-length sequences and waves of the packed kernels.

Where it sits: the planning half of `packed.py` (the "flash_attn" and "torch_flash"
backends): `sequences` turns the blocks of `ops/blocks.py` into varlen sequences with
their bottom-right band (left, right), `waves` groups them into kernel calls. Pure Python
over index ranges; no tensor is touched.
Guarantees: each sequence's band reproduces our global-position rule exactly; a packed
micro-batch, a zigzag ring step and an FPDT chunk pair each become one kernel call; within
a wave a query row appears at most once, so results scatter without a merge.
The band conversion and the joining rule: docs/DESIGN.md "Devices and kernels"."""

from __future__ import annotations

import bisect

from typing import NamedTuple, Sequence

from hf_longctx.ops.blocks import Block


class Seq(NamedTuple):
    """One varlen sequence: local query rows `q`, local key ranges `k` (gathered in this
    order), the bottom-right band (left, right), and the query piece it came from."""

    piece: tuple[int, int]
    q: tuple[int, int]
    k: tuple[tuple[int, int], ...]
    left: int
    right: int


def _band(causal: bool, window: int | None) -> tuple[float, float]:
    """Allowed i - j: [dlo, dhi]."""
    inf = float("inf")
    if causal:
        return 0, inf if window is None else window - 1
    return (-inf, inf) if window is None else (-(window - 1), window - 1)


def _trimmed(b: Block, dlo: float, dhi: float) -> Seq:
    """A masked tile as one sequence: rows that see a key, keys that some row sees, the band."""
    q0, q1 = b.q_start, b.q_start + b.q_hi - b.q_lo  # global [q0, q1)
    k0, k1 = b.k_start, b.k_start + b.k_hi - b.k_lo
    q0, q1 = int(max(q0, k0 + dlo)), int(min(q1, k1 - 1 + dhi + 1))  # rows i with a j in [i-dhi, i-dlo]
    k0, k1 = int(max(k0, q0 - dhi)), int(min(k1, q1 - 1 - dlo + 1))
    shift = q1 - k1
    left = -1 if dhi == float("inf") else int(dhi - shift)
    right = -1 if dlo == -float("inf") else int(shift - dlo)
    lq, lk = b.q_lo + q0 - b.q_start, b.k_lo + k0 - b.k_start
    return Seq((b.q_lo, b.q_hi), (lq, lq + q1 - q0), ((lk, lk + k1 - k0),), left, right)


def sequences(blocks: Sequence[Block], *, causal: bool, window: int | None) -> list[Seq]:
    dlo, dhi = _band(causal, window)
    by_piece: dict[tuple[int, int], list[Block]] = {}
    for b in blocks:
        by_piece.setdefault((b.q_lo, b.q_hi), []).append(b)
    main, rest_seqs = [], []
    for piece, bs in by_piece.items():
        full = sorted((b for b in bs if b.kind == "full"), key=lambda b: b.k_start)
        diag = [b for b in bs if b.kind == "causal"]
        rest = [b for b in bs if b.kind == "masked"]
        if diag and any(b.k_start >= diag[0].q_start for b in full):  # not "earlier keys + diagonal": keep apart
            rest, diag = rest + diag, []
        if full or diag:
            keys = tuple((b.k_lo, b.k_hi) for b in full + diag)  # global order: earlier keys, then the diagonal
            main.append(Seq(piece, piece, keys, -1, 0 if diag else -1))
        rest_seqs.extend(_trimmed(b, dlo, dhi) for b in rest)
    return _joined(main) + rest_seqs


def _coalesced(ranges: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


def _join(a: Seq, b: Seq) -> Seq | None:
    """One sequence computing exactly what `a` then `b` (adjacent query rows) compute, or None.

    - both unbounded over the same keys: the rows of both see those keys;
    - a chain of diagonals: `a` attends its own positions causally (one key range, as many
      keys as rows) and `b` attends a's keys, then its own positions causally. Bottom-right
      causal over a's keys + b's keys then gives every row of a its keys up to itself and
      every row of b all of a's plus its own up to itself -- a zigzag chunk pair of one
      document at ring step 0, or consecutive FPDT chunks, as ONE sequence whose keys are
      the local rows in order (no key gathered twice)."""
    if a.q[1] != b.q[0]:
        return None
    q = (a.q[0], b.q[1])
    if (a.left, a.right) == (b.left, b.right) == (-1, -1) and a.k == b.k:
        return Seq(q, q, a.k, -1, -1)
    if (a.left, a.right) == (b.left, b.right) == (-1, 0):
        ka, kb = _coalesced(a.k), _coalesced(b.k)
        if len(ka) == 1 and len(kb) == 1 and ka[0][1] - ka[0][0] == a.q[1] - a.q[0] and kb[0][0] == ka[0][0]:
            if kb[0][1] - ka[0][1] == b.q[1] - b.q[0]:  # b's own keys follow a's, as many as its rows
                return Seq(q, q, kb, -1, 0)
    return None


def _joined(seqs: list[Seq]) -> list[Seq]:
    out: list[Seq] = []
    for s in sorted(seqs, key=lambda s: s.q):
        joined = _join(out[-1], s) if out else None
        if joined is None:
            out.append(s)
        else:
            out[-1] = joined
    return out


def _fits(s: Seq, band: tuple[int, int]) -> bool:
    """Sequence `s` computes exactly its own band under `band`: the same band, or an
    unbounded one (every pair allowed) whose rows all see every key under `band` too
    (bottom-right: right >= nq - 1 and left >= nk - 1) -- e.g. a 1-token zigzag chunk."""
    if band == (s.left, s.right):
        return True
    if (s.left, s.right) != (-1, -1):
        return False
    nq, nk = s.q[1] - s.q[0], sum(hi - lo for lo, hi in s.k)
    return (band[1] == -1 or band[1] >= nq - 1) and (band[0] == -1 or band[0] >= nk - 1)


def waves(seqs: Sequence[Seq], *, bottom_right: bool = True) -> list[list[Seq]]:
    """Greedy packing: one (left, right) per wave, each query row at most once per wave;
    banded sequences open the waves, unbounded ones join any wave they fit -- under a
    bottom-right band only (`_fits`); a top-left kernel (`bottom_right=False`) takes a sequence
    into a wave of its own band alone."""
    result: list[tuple[tuple[int, int], list, list[Seq]]] = []
    for s in sorted(seqs, key=lambda s: (s.left, s.right) == (-1, -1)):  # stable: banded first
        for band, rows, members in result:
            # rows: the wave's query ranges, disjoint and sorted, so their ends are sorted too:
            # s.q overlaps one iff the last range starting before s.q's end ends after its start
            i = bisect.bisect_left(rows, (s.q[1],))
            fits = _fits(s, band) if bottom_right else band == (s.left, s.right)
            if fits and not (i and rows[i - 1][1] > s.q[0]):
                rows.insert(i, tuple(s.q))
                members.append(s)
                break
        else:
            result.append(((s.left, s.right), [s.q], [s]))
    return [members for _, _, members in result]
