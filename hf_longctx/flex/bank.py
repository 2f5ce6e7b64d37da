"""The group bank: one aligned SP group of every power-of-two size, built once at init.

Where it sits: replaces the single `SPMesh` of `init_sequence_parallel` when a step may use
SP groups of different sizes (FlexSP §3, Hydraulis §4); built on every rank in the same
order (group creation is collective), then passed to `patch()` and `flex/step.py`. For
every size s this rank is in exactly one aligned group, ranks [g·s, (g+1)·s), g = rank // s:
one `SPMesh` per size, so everything that takes an `SPMesh` works per group unchanged.
Guarantee: optimisation is NOT grouped: every mesh carries the same world mesh, so FSDP2
shards over the world and gradients are summed over the world (invariant 6)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hf_longctx.sp_groups import GroupShape, group_shapes
from hf_longctx.distributed.mesh import SPMesh, process_group_world
from hf_longctx.distributed.loss import collective_device


@dataclass(frozen=True)
class GroupBank:
    """This rank's view of every group size: `bank.mesh(size)` is its SP group of that size.

    Built by `init_group_bank`; pass it where a mesh goes (`patch`, the trainers).

    Attributes:
        world_size: Ranks in the world.
        rank: This rank's global rank.
        shapes: The group shapes, smallest first.
        meshes: This rank's `SPMesh` of each shape, in the same order.
        world_mesh: The 1-D `DeviceMesh` over the world (FSDP), or None in one process.
    """

    world_size: int
    rank: int
    shapes: tuple[GroupShape, ...]
    meshes: tuple[SPMesh, ...] = field(compare=False, repr=False)  # one per shape, same order
    world_mesh: Any = field(default=None, compare=False, repr=False)  # 1-D DeviceMesh over the world (FSDP)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The group sizes the bank holds, smallest first."""
        return tuple(s.size for s in self.shapes)

    @property
    def min_size(self) -> int:
        """The smallest group size."""
        return self.shapes[0].size

    @property
    def max_size(self) -> int:
        """The largest group size."""
        return self.shapes[-1].size

    @property
    def fpdt_chunks(self) -> int:
        """The most FPDT chunks any group size runs with."""
        return max(s.fpdt_chunks for s in self.shapes)

    def shape(self, size: int) -> GroupShape:
        """The Ulysses x ring shape of the bank's groups of `size` ranks."""
        for s in self.shapes:
            if s.size == size:
                return s
        raise ValueError(f"the group bank has no group of size {size}; its sizes are {list(self.sizes)}")

    def mesh(self, size: int) -> SPMesh:
        """This rank's SP group of `size` ranks, as an SPMesh (dp = world / size)."""
        return self.meshes[self.shapes.index(self.shape(size))]

    def group_index(self, size: int) -> int:
        """Index g of this rank's group of `size`: it covers ranks [g·size, (g+1)·size)."""
        self.shape(size)
        return self.rank // size

    @property
    def world(self) -> SPMesh:
        """A mesh of the bank for world-wide work (`fsdp_plan(model, bank.world)`, the loss
        all-reduce): every mesh of the bank has the same world mesh; this is the largest."""
        return self.meshes[-1]

    @property
    def patch_mesh(self) -> SPMesh:
        """The mesh `patch()` validates options against and falls back to: the largest group
        that carries FPDT chunks if any does (kv_offload needs them), else the largest."""
        chunked = [m for m, s in zip(self.meshes, self.shapes) if s.fpdt_chunks > 1]
        return chunked[-1] if chunked else self.meshes[-1]


def _warm_up(meshes: tuple[SPMesh, ...], device: torch.device) -> None:
    """One tiny all-reduce on every group this rank belongs to, in the same order on every
    rank: NCCL creates a communicator at a group's first collective (seconds at scale), and
    the first training step must not pay for it inside its timed micro-batches."""
    for m in meshes:
        for group in (m.ulysses_group, m.ring_group, m.sp_group):
            if group is not None:
                dist.all_reduce(torch.ones(1, device=device), group=group)  # [1]
    if meshes and meshes[-1].world_mesh is not None:
        dist.all_reduce(torch.ones(1, device=device), group=meshes[-1].world_mesh.get_group())  # [1]


def init_group_bank(
    *, heads: int, min_size: int = 1, max_size: int | None = None, ranks_per_node: int | None = None, fpdt_chunks: int = 1,
    warm_up: bool = True,
) -> GroupBank:
    """Build the bank over the default process group; call it on every rank.

    Args:
        heads: The model's query-head count (bounds the Ulysses degree of every group).
        min_size: The smallest SP group a step may use (a power of two).
        max_size: The largest SP group a step may use (a power of two; default: the world).
        ranks_per_node: GPUs per node (default: the local CUDA device count, or the world on
            CPU: `sp_groups.default_ranks_per_node`, as in `group_shapes`) -- Ulysses stays
            within a node, the ring spans nodes.
        fpdt_chunks: FPDT chunks of the groups with ring 1 and size > 1.
        warm_up: Run one tiny all-reduce on every group this rank belongs to, so that the
            first step does not pay for creating their communicators.

    Returns:
        This rank's bank, one `SPMesh` per group size.

    Raises:
        ValueError: A size is not a power of two, `min_size` > `max_size`, or `max_size`
            does not divide the world (`group_shapes`).
        NotSupported: A launcher started several processes and no process group exists
            yet.
    """
    initialised, world = process_group_world("init_group_bank")
    max_size = world if max_size is None else max_size
    # Pure validation first: a bad setting raises the same error on every rank, before any group exists.
    shapes = group_shapes(
        world, heads=heads, min_size=min_size, max_size=max_size, ranks_per_node=ranks_per_node, fpdt_chunks=fpdt_chunks
    )
    if not initialised:
        mesh = SPMesh(dp=1, ring=1, ulysses=1, fpdt_chunks=1, dp_rank=0, ring_rank=0, ulysses_rank=0)
        return GroupBank(world_size=1, rank=0, shapes=shapes, meshes=(mesh,))

    from hf_longctx.distributed.mesh import init_sequence_parallel

    meshes = []
    for shape in shapes:  # same order on every rank: group creation is collective
        meshes.append(init_sequence_parallel(shape.ulysses, shape.ring, shape.fpdt_chunks))
    # One world mesh for all (each init above flattened its own; FSDP and the loss use this one).
    world_mesh = meshes[-1].world_mesh
    meshes = tuple(dataclasses.replace(m, world_mesh=world_mesh) for m in meshes)
    if warm_up:
        device = collective_device(dist.group.WORLD)
        _warm_up(meshes, device)
    return GroupBank(world_size=world, rank=dist.get_rank(), shapes=shapes, meshes=meshes, world_mesh=world_mesh)
