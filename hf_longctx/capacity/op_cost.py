"""The unit of the step-time model: one kind of GPU op with its work, and the tally of a stream.

Where it sits: the common language of the two sides of the step-time model. The recorder
(`benchmarks/_op_stream.py`) writes one `Op` per kernel, collective or copy a real patched
step issues on the CUDA dispatch path (emulated on CPU); the inventory
(`capacity/inventory.py`) writes the same ops in closed form for any size; `capacity/roofline.py`
turns either into seconds. Guarantees: an op's numbers are per call, `count` repeats it, so a
tally of an inventory and of a recording compare field by field (`Tally.of`).
Attention work is counted in (query, key) pairs the kernel visits (`attention_pairs`): causal
and windowed masks bottom-right aligned, as flash-attn's varlen kernels read them. The
combinators the inventory composes op lists with (`times`, `each`, `summed`, `split`, `pcie`)
live here beside the unit they combine."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

# Kinds of op and where their time goes (capacity/roofline.py):
GEMM, ATTN_FWD, ATTN_BWD, ELEMENTWISE = "gemm", "attention_fwd", "attention_bwd", "elementwise"  # compute stream
COLLECTIVE, P2P = "collective", "p2p"  # a link: all-to-all, all-gather, reduce-scatter / ring sends
H2D, D2H = "h2d", "d2h"  # PCIe copies
KINDS = (GEMM, ATTN_FWD, ATTN_BWD, ELEMENTWISE, COLLECTIVE, P2P, H2D, D2H)


@dataclass(frozen=True)
class Op:
    """One call of a GPU op, `count` times. `bytes`: HBM bytes read plus written; `wire`:
    bytes this rank sends over `link` ("ulysses", "ring", "fsdp" or "pcie"); `stream`:
    "main" (the compute stream), or "side" (host-offload copies on their own streams)."""

    kind: str
    flops: float = 0.0
    bytes: float = 0.0
    link: str = ""
    wire: float = 0.0
    stream: str = "main"
    count: float = 1.0
    what: str = ""  # a label for tables (the aten op, or the inventory's name for it)

    def times(self, n: float) -> "Op":
        return replace(self, count=self.count * n)


@dataclass
class Tally:
    """Totals of a stream by kind: launches, FLOPs, HBM bytes; link bytes by link."""

    launches: dict = field(default_factory=dict)
    flops: dict = field(default_factory=dict)
    bytes: dict = field(default_factory=dict)
    wire: dict = field(default_factory=dict)

    @classmethod
    def of(cls, ops) -> "Tally":
        t = cls()
        for op in ops:
            for name, value in (("launches", op.count), ("flops", op.flops * op.count), ("bytes", op.bytes * op.count)):
                d = getattr(t, name)
                d[op.kind] = d.get(op.kind, 0.0) + value
            if op.link:
                t.wire[op.link] = t.wire.get(op.link, 0.0) + op.wire * op.count
        return t

    def as_dict(self) -> dict:
        return {f"{f.name}:{k}": v for f in fields(self) for k, v in sorted(getattr(self, f.name).items())}


def times(ops: list[Op], k: int) -> list[Op]:
    """`ops` run k times."""
    return [op.times(k) for op in ops] if k > 0 else []


def each(sizes: list[int], ops_of) -> list[Op]:
    """ops_of(size) for every size (chunks of equal size share one entry with a count)."""
    from collections import Counter

    return [op for size, k in Counter(sizes).items() for op in times(ops_of(size), k)]


def summed(sizes: list[int], ops_of) -> list[Op]:
    """ops_of(size, fresh) for every row chunk of a backward under `ops/grad_sums.GradSums`:
    the first chunk starts the fp32 sums (fresh), the others add into them."""
    return ops_of(sizes[0], True) + each(sizes[1:], lambda c: ops_of(c, False)) if sizes else []


def split(n: int, chunks: int) -> list[int]:
    """Row counts of torch.tensor_split(n rows, chunks)."""
    chunks = max(1, min(chunks, n))
    return [n // chunks + 1] * (n % chunks) + [n // chunks] * (chunks - n % chunks)


def pcie(kind: str, nbytes: float, what: str = "offload") -> Op:
    """A copy between host and device on the offload side streams (`ops/offload.py`)."""
    return Op(kind, bytes=float(nbytes), link="pcie", wire=float(nbytes), stream="side", what=what)


def attention_pairs(nq: int, nk: int, causal: bool, left: int = -1, right: int = -1) -> int:
    """(query, key) pairs one sequence of a varlen kernel call visits: `nq` queries over `nk`
    keys, bottom-right aligned (query r sits at key position r + nk - nq); `causal` forces
    right = 0; -1 = unbounded. Closed form (a sum over rows of a clipped band)."""
    right = 0 if causal else right
    off = nk - nq

    def upto(bound_of_row_offset: int) -> int:
        # sum over rows r of clip(r + off + bound + 1, 0, nk): keys at positions <= r + off + bound
        return sum_clipped(nq, off + bound_of_row_offset + 1, nk)

    hi = upto(right) if right >= 0 else nq * nk
    lo = upto(-left - 1) if left >= 0 else 0  # keys strictly before r + off - left
    return hi - lo


def sum_clipped(n: int, start: int, cap: int) -> int:
    """sum_{r=0}^{n-1} clip(r + start, 0, cap), in O(1)."""
    if n <= 0 or cap <= 0:
        return 0

    def tri(a: int, b: int) -> int:  # sum of r + start for r in [a, b)
        return (b - a) * start + (a + b - 1) * (b - a) // 2 if b > a else 0

    first_pos = max(0, -start + 1)  # rows where r + start >= 1
    first_cap = max(0, cap - start)  # rows where r + start >= cap
    a, b = min(first_pos, n), min(first_cap, n)
    return tri(a, max(a, b)) + max(0, n - max(a, b)) * cap
