"""Varlen sequences for kernels whose causal flag is top-left aligned: every causal call square.

Where it sits: between `sequences.py` (bottom-right bands, what the flash kernels take) and
`packed.py`'s waves, for the kernels that declare `square_causal` -- cuDNN through torch's
`aten::_cudnn_attention_forward/_backward` (`cudnn.py`), whose varlen path masks from the
top-left corner of each sequence (torch's `MHA.cpp`: `CausalMask::TOP_LEFT` unless a KV cache
length is given, which that op cannot take) and has no window. Top-left and bottom-right agree
only on square sequences, so a bottom-right band (-1, r), r >= 0, over nq rows and nk keys --
row i sees keys [0, i + nk - nq + r] -- is cut into at most three exact pieces: the key prefix
every row sees (full), the staircase as one SQUARE causal sequence, and the rows that see every
key (full). Pure Python over index ranges; the pieces of one row range land in different waves
and merge by LSE in `packed.py`."""

from __future__ import annotations

from typing import Sequence

from hf_longctx.ops.backends.sequences import Seq


def _key_slice(keys: tuple[tuple[int, int], ...], lo: int, hi: int) -> tuple[tuple[int, int], ...]:
    """Positions [lo, hi) of the gathered key order as local key ranges."""
    out, at = [], 0
    for a, b in keys:
        n = b - a
        s, e = max(lo, at), min(hi, at + n)
        if s < e:
            out.append((a + s - at, a + e - at))
        at += n
    return tuple(out)


def square_pieces(s: Seq) -> list[Seq]:
    """`s` as exact sequences that are unbounded (-1, -1) or square causal (-1, 0) under a
    top-left causal flag; raises for a sliding window (a left bound), which such kernels lack."""
    if (s.left, s.right) == (-1, -1):
        return [s]
    if s.left != -1:
        raise ValueError(
            f"a sequence with band (left={s.left}, right={s.right}) needs a sliding window, which a top-left causal "
            "kernel without windows cannot compute; the dispatcher must refuse windows for it"
        )
    q0, q1 = s.q
    nq, nk = q1 - q0, sum(b - a for a, b in s.k)
    shift = nk - nq + s.right  # row i sees gathered keys [0, i + shift]
    first = max(0, -shift)  # rows before it see no key: left to the merge identity
    if first >= nq or nk == 0:
        return []
    prefix = shift + first  # keys every row from `first` on sees
    if prefix >= nk - 1:  # row `first` already sees every key
        return [Seq(s.piece, (q0 + first, q1), s.k, -1, -1)]
    m = min(nq - first, nk - prefix)  # the staircase: rows first.. first+m-1 over keys prefix.. prefix+m-1
    rows = (q0 + first, q0 + first + m)
    out = []
    if prefix > 0:
        out.append(Seq(s.piece, rows, _key_slice(s.k, 0, prefix), -1, -1))
    out.append(Seq(s.piece, rows, _key_slice(s.k, prefix, prefix + m), -1, 0))
    if first + m < nq:  # these rows see every key
        out.append(Seq(s.piece, (rows[1], q1), s.k, -1, -1))
    return out


def square_sequences(seqs: Sequence[Seq]) -> list[Seq]:
    return [p for s in seqs for p in square_pieces(s)]
