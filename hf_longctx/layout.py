"""The token permutation of one sequence-parallel rank, as a pure function.

Where it sits: below `data/`, importing only torch. `data/sharding.py` gathers every
per-token tensor with these indices (through `SPMesh.local_indices`), and `ops/` uses the
same runs to know which global positions each block holds. No process group: the same
inputs give the same layout on every rank (invariant 8). Layouts: zigzag over the ring (USP
Algorithm 2: document in 2R chunks, ring rank r holds r and 2R-1-r, equal causal work);
contiguous over Ulysses (Algorithm 1: the all-to-all rebuilds the ring rank's stream);
rank-ordinal FPDT chunks (Figure 6: Ulysses rank j holds pieces j, U+j, ..., so chunk i's
all-to-all gathers global segment i). A layout is a list of `Run`s: consecutive local
tokens that are consecutive global positions of one document. `RankLayout` is what the data
stage asks of one rank's mesh (`SPMesh` answers it with these functions)."""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol, Sequence, runtime_checkable

import torch


class Run(NamedTuple):
    """`length` consecutive global positions `start ...` of document `doc`, stored
    consecutively in a local tensor."""

    doc: int
    start: int
    length: int


def doc_multiple(ring: int) -> int:
    """Every document's length must be a multiple of this: 2R chunks for the zigzag, or
    1 when there is no ring."""
    return 2 * ring if ring > 1 else 1


def seq_multiple(ring: int, ulysses: int, fpdt_chunks: int = 1) -> int:
    """The packed total length must be a multiple of this: every ring rank's stream
    (S/R tokens) splits into U equal Ulysses pieces, or into u·U FPDT pieces."""
    if fpdt_chunks > 1:
        return fpdt_chunks * ulysses
    return math.lcm(doc_multiple(ring), ring * ulysses)


def check_boundaries(cu_seqlens: Sequence[int], ring: int, ulysses: int, fpdt_chunks: int = 1) -> list[int]:
    """Validate document boundaries and return them as a list of Python ints.

    Raises ValueError naming the offending documents: every rank runs this on the same
    boundaries before any collective, so they all raise together instead of hanging.
    """
    cu = [int(x) for x in cu_seqlens]
    if len(cu) < 2 or cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 and hold at least one document, got {cu[:8]}")
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    empty = [i for i, n in enumerate(lengths) if n <= 0]
    if empty:
        raise ValueError(f"cu_seqlens must be strictly increasing; documents {empty[:8]} have length <= 0")
    dm = doc_multiple(ring)  # FPDT needs ring 1 (refused otherwise), where this is 1
    bad = [(i, n) for i, n in enumerate(lengths) if n % dm]
    if bad:
        shown = ", ".join(f"document {i} has length {n}" for i, n in bad[:8])
        raise ValueError(
            f"with ring degree {ring} every document length must be a multiple of "
            f"doc_multiple = 2 x ring = {dm}: {shown}{' ...' if len(bad) > 8 else ''}; "
            "pad documents with hf_longctx.shard_batch"
        )
    sm = seq_multiple(ring, ulysses, fpdt_chunks)
    if cu[-1] % sm:
        raise ValueError(
            f"packed length {cu[-1]} is not a multiple of seq_multiple = {sm} "
            f"(ring {ring}, ulysses {ulysses}, fpdt_chunks {fpdt_chunks}); pad with hf_longctx.shard_batch"
        )
    return cu


def runs_of_range(cu: Sequence[int], start: int, end: int) -> list[Run]:
    """The global range [start, end) cut at document boundaries."""
    runs = []
    for doc, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        lo, hi = max(a, start), min(b, end)
        if lo < hi:
            runs.append(Run(doc, lo, hi - lo))
    return runs


def ring_stream(cu: Sequence[int], ring: int, ring_rank: int) -> list[Run]:
    """The tokens of ring rank `ring_rank` after the Ulysses all-to-all: for every
    document, its chunk r then its chunk 2R-1-r (zigzag); the whole sequence if R = 1."""
    if ring == 1:
        return runs_of_range(cu, cu[0], cu[-1])
    runs = []
    for doc, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        c = (b - a) // (2 * ring)  # chunk length of this document
        runs.append(Run(doc, a + ring_rank * c, c))
        runs.append(Run(doc, a + (2 * ring - 1 - ring_rank) * c, c))
    return runs


def slice_runs(runs: Sequence[Run], lo: int, hi: int) -> list[Run]:
    """Local tokens [lo, hi) of a run stream, as runs."""
    out, offset = [], 0
    for run in runs:
        a, b = max(lo, offset), min(hi, offset + run.length)
        if a < b:
            out.append(Run(run.doc, run.start + a - offset, b - a))
        offset += run.length
    return out


def total_length(runs: Sequence[Run]) -> int:
    return sum(r.length for r in runs)


def fpdt_chunk_range(total: int, fpdt_chunks: int, chunk: int) -> tuple[int, int]:
    """Global range gathered by the `chunk`-th FPDT all-to-all."""
    step = total // fpdt_chunks
    return chunk * step, (chunk + 1) * step


def local_runs(
    cu: Sequence[int], *, ring: int, ulysses: int, ring_rank: int, ulysses_rank: int, fpdt_chunks: int = 1
) -> list[Run]:
    """The runs one SP rank holds, in local order."""
    if fpdt_chunks > 1:
        if ring != 1:
            raise ValueError(f"fpdt_chunks ({fpdt_chunks}) > 1 needs ring degree 1, got ring {ring}")
        piece = cu[-1] // (fpdt_chunks * ulysses)
        runs = []
        for i in range(fpdt_chunks):
            start = (i * ulysses + ulysses_rank) * piece
            runs.extend(runs_of_range(cu, start, start + piece))
        return runs
    stream = ring_stream(cu, ring, ring_rank)
    piece = total_length(stream) // ulysses
    return slice_runs(stream, ulysses_rank * piece, (ulysses_rank + 1) * piece)


def runs_to_indices(runs: Sequence[Run]) -> torch.Tensor:
    """int64 [S_local] global positions of a run stream."""
    if not runs:
        return torch.empty(0, dtype=torch.long)
    return torch.cat([torch.arange(r.start, r.start + r.length, dtype=torch.long) for r in runs])


def local_indices(
    cu_seqlens: Sequence[int], *, ring: int, ulysses: int, ring_rank: int, ulysses_rank: int, fpdt_chunks: int = 1
) -> torch.Tensor:
    """int64 [S_local]: the global token positions one SP rank holds, in local order."""
    cu = check_boundaries(cu_seqlens, ring, ulysses, fpdt_chunks)
    return runs_to_indices(
        local_runs(cu, ring=ring, ulysses=ulysses, ring_rank=ring_rank, ulysses_rank=ulysses_rank, fpdt_chunks=fpdt_chunks)
    )


@runtime_checkable
class RankLayout(Protocol):
    """One rank's SP group as the data stage reads it (`data/sharding.py`, the collators): its
    degrees and ranks, the padding multiples and the global positions it holds. `SPMesh`
    (`distributed/mesh.py`) implements it; declared here, below `data/`, which may not import
    the process groups a mesh carries."""

    @property
    def dp(self) -> int: ...  # SP groups in the world

    @property
    def dp_rank(self) -> int: ...  # which SP group this rank is in

    @property
    def sp(self) -> int: ...  # ranks of the SP group (ring x ulysses)

    @property
    def sp_rank(self) -> int: ...  # this rank's place in its SP group

    @property
    def ring(self) -> int: ...

    @property
    def ulysses(self) -> int: ...

    @property
    def fpdt_chunks(self) -> int: ...

    @property
    def doc_multiple(self) -> int: ...  # every document padded to a multiple of this

    @property
    def seq_multiple(self) -> int: ...  # the packed total padded to a multiple of this

    def local_indices(self, cu_seqlens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """int64 [S_local]: the global positions this rank holds, in local order."""
        ...
