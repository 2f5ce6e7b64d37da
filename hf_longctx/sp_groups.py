"""The shapes of the SP groups a flexible step may use: size, Ulysses × ring split, padding.

Where it sits: pure arithmetic beside `hf_longctx/layout.py`, shared by the group bank,
the flexible planner (capacities without a process group), `data/cost.GroupCost` and the
mixers' binding. FlexSP §3 / Hydraulis §4: power-of-two sizes, aligned ("buddy" layout:
any multiset of sizes summing to the world tiles it, largest first).
Split of a group of size s: Ulysses U = the largest power of two dividing the query heads,
s and the ranks of a node (the heaviest traffic on the fastest links; KV replication in
`ops/ulysses.py`), ring R = s / U; FPDT chunks only with ring 1."""

from __future__ import annotations

from dataclasses import dataclass

from hf_longctx import layout


def _pow2(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 1, got {value!r}")
    return value


def ulysses_split(size: int, heads: int, ranks_per_node: int) -> tuple[int, int]:
    """(U, R) of a group of `size` ranks: U the largest power of two dividing heads, size
    and ranks_per_node; R = size / U."""
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ValueError(f"heads must be a positive int (query heads of the model), got {heads!r}")
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
    u = 1
    while size % (2 * u) == 0 and heads % (2 * u) == 0 and ranks_per_node % (2 * u) == 0:
        u *= 2
    return u, size // u


@dataclass(frozen=True)
class GroupShape:
    """One SP group size of the bank and how its ranks split.

    Attributes:
        size: Ranks in the group (ulysses x ring).
        ulysses: Its Ulysses degree.
        ring: Its ring degree.
        fpdt_chunks: Its FPDT chunks (1: no FPDT).
    """

    size: int
    ulysses: int
    ring: int
    fpdt_chunks: int = 1

    @property
    def doc_multiple(self) -> int:
        """Every document is padded to a multiple of this in a group of this shape."""
        return layout.doc_multiple(self.ring)

    @property
    def seq_multiple(self) -> int:
        """A micro-batch of this shape is padded to a multiple of this."""
        return layout.seq_multiple(self.ring, self.ulysses, self.fpdt_chunks)

    def padded(self, length: int) -> int:
        """Tokens a document of `length` occupies in a group of this shape."""
        m = self.doc_multiple
        return -(-length // m) * m

    def capacity(self, max_tokens_per_rank: int) -> int:
        """Padded tokens one micro-batch of this group may hold: size × per-rank tokens,
        rounded down to the packed-length multiple (the total is padded up to it)."""
        cap = self.size * max_tokens_per_rank
        return cap // self.seq_multiple * self.seq_multiple


def default_ranks_per_node(world_size: int) -> int:
    """The one `ranks_per_node` default of `group_shapes`, `init_group_bank` and
    `GroupCost.from_config`: the local CUDA device count, or the whole world without CUDA
    (CPU ranks share one machine), never more than the world."""
    import torch

    local = torch.cuda.device_count() if torch.cuda.is_available() else world_size
    return max(1, min(local, world_size))


def group_shapes(
    world_size: int, *, heads: int, min_size: int = 1, max_size: int | None = None, ranks_per_node: int | None = None,
    fpdt_chunks: int = 1,
) -> tuple[GroupShape, ...]:
    """Every power-of-two group size from `min_size` to `max_size` (default: the world),
    smallest first, with its split: Ulysses as wide as the heads and one node allow, the
    ring over the rest.

    Args:
        world_size: Ranks in the world.
        heads: The model's query-head count (bounds each Ulysses degree).
        min_size: The smallest group size (a power of two).
        max_size: The largest group size (a power of two dividing the world; default: the
            world).
        ranks_per_node: GPUs per node (default: `default_ranks_per_node`).
        fpdt_chunks: FPDT chunks of the shapes with ring 1 and size > 1.

    Returns:
        One `GroupShape` per size, smallest first.

    Raises:
        ValueError: Naming the offending values: a size that is not a power of two,
            `min_size` > `max_size`, or `max_size` not dividing the world.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if ranks_per_node is None:
        ranks_per_node = default_ranks_per_node(world_size)
    max_size = world_size if max_size is None else max_size
    _pow2("min_size", min_size)
    _pow2("max_size", max_size)
    if isinstance(fpdt_chunks, bool) or not isinstance(fpdt_chunks, int) or fpdt_chunks < 1:
        raise ValueError(f"fpdt_chunks must be a positive int, got {fpdt_chunks!r}")
    if min_size > max_size:
        raise ValueError(f"min_size ({min_size}) > max_size ({max_size})")
    if world_size % max_size:
        raise ValueError(
            f"max_size ({max_size}) does not divide world size {world_size}: aligned groups of every size must tile "
            f"the world; use a power of two dividing {world_size}"
        )
    shapes, s = [], min_size
    while s <= max_size:
        u, r = ulysses_split(s, heads, ranks_per_node)
        shapes.append(GroupShape(size=s, ulysses=u, ring=r, fpdt_chunks=fpdt_chunks if r == 1 and s > 1 else 1))
        s *= 2
    return tuple(shapes)
