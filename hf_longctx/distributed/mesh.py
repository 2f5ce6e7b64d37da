"""The frozen sequence-parallel mesh: dp × ring × ulysses.

Where it sits: built once per job by `hf_longctx.init_sequence_parallel`, then passed to
`patch()`, `shard_batch()`, the collator and `usp_attention()` -- never a module global. It
owns the process groups (USP §3: Ulysses innermost, on the fastest links; ring next; DP
outermost) and answers layout questions with the pure functions of `hf_longctx/layout.py`.
Global rank = dp_rank · (R·U) + ring_rank · U + ulysses_rank.
Without torch.distributed (one process, every degree 1) the groups are None and every
collective in `distributed/comm.py` is the identity; `one_rank_world` gives such a mesh the
one-rank world mesh FSDP2 needs to offload parameters to host memory."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch
import torch.distributed as dist

from hf_longctx import layout
from hf_longctx.errors import NotSupported
from hf_longctx.sp_groups import GroupShape


def _check_degree(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_degrees(world_size: int, ulysses: int, ring: int, fpdt_chunks: int = 1) -> int:
    """Validate the factorisation and return the data-parallel degree.

    Pure: run by every rank before any process group is created, so a bad setting raises
    the same ValueError everywhere instead of hanging in a collective.
    """
    _check_degree("ulysses_degree", ulysses)
    _check_degree("ring_degree", ring)
    _check_degree("fpdt_chunks", fpdt_chunks)
    sp = ulysses * ring
    if world_size % sp:
        launch = (
            f"launch {sp} processes (or a multiple of {sp}): torchrun --nproc-per-node {sp} SCRIPT, or accelerate "
            f"launch with num_processes: {sp} in its config -- on CPU distributed_type MULTI_GPU with use_cpu: true "
            "(as the repository's accelerate_configs/cpu_4proc.yaml), since Accelerate's MULTI_CPU starts one process "
            "unless an MPI hostfile is given"
        )
        if world_size == 1:
            raise NotSupported(
                f"ulysses({ulysses}) x ring({ring}) = {sp} does not divide world size 1: this process runs alone (it was "
                "started without a launcher, or by one that started a single process)",
                f"{launch}; or, on one process, ulysses_degree=1 and ring_degree=1",
            )
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise NotSupported(
            f"ulysses({ulysses}) x ring({ring}) = {sp} does not divide world size {world_size}",
            f"choose degrees whose product divides {world_size} (one of {divisors}), or {launch}",
        )
    if fpdt_chunks > 1 and ring > 1:
        raise ValueError(
            f"fpdt_chunks({fpdt_chunks}) > 1 needs ring_degree 1 (got ring {ring}): FPDT chunks the "
            "Ulysses all-to-all; use ulysses_degree for the SP degree"
        )
    return world_size // sp


@dataclass(frozen=True)
class SPMesh:
    """Degrees, ranks and process groups of one rank's view of the 3D mesh.

    Built by `init_sequence_parallel` (or `mesh_from_parallelism_config`); frozen.

    Attributes:
        dp: Data-parallel degree (SP groups in the world).
        ring: Ring degree R.
        ulysses: Ulysses degree U.
        fpdt_chunks: FPDT chunks per Ulysses all-to-all (1: no FPDT).
        dp_rank: Which SP group this rank belongs to.
        ring_rank: This rank's place on the ring.
        ulysses_rank: This rank's place in its Ulysses group.
        device_mesh: The `DeviceMesh` ("dp", "ring", "ulysses"), or None in one process.
        world_mesh: The 1-D `DeviceMesh` over the whole world (FSDP), or None.
        ulysses_group: The Ulysses process group, or None.
        ring_group: The ring process group, or None.
        sp_group: The SP group (ring x ulysses), or None.
        dp_group: The data-parallel group, or None.
    """

    dp: int
    ring: int
    ulysses: int
    fpdt_chunks: int
    dp_rank: int
    ring_rank: int
    ulysses_rank: int
    device_mesh: Any = field(default=None, compare=False, repr=False)  # DeviceMesh("dp","ring","ulysses") or None
    world_mesh: Any = field(default=None, compare=False, repr=False)  # 1D DeviceMesh over the whole world (FSDP)
    ulysses_group: Any = field(default=None, compare=False, repr=False)
    ring_group: Any = field(default=None, compare=False, repr=False)
    sp_group: Any = field(default=None, compare=False, repr=False)
    dp_group: Any = field(default=None, compare=False, repr=False)

    # ---- degrees and ranks -------------------------------------------------------------
    @property
    def sp(self) -> int:
        """The SP degree: ranks per SP group (ring x ulysses)."""
        return self.ring * self.ulysses

    @property
    def sp_rank(self) -> int:
        """This rank's place in its SP group (ring rank x ulysses + ulysses rank)."""
        return self.ring_rank * self.ulysses + self.ulysses_rank

    @property
    def world_size(self) -> int:
        """All ranks of the mesh (dp x sp)."""
        return self.dp * self.sp

    @property
    def rank(self) -> int:
        """This rank's global rank (dp rank x sp + sp rank)."""
        return self.dp_rank * self.sp + self.sp_rank

    def global_rank(self, *, ring_rank: int, ulysses_rank: int | None = None) -> int:
        """Global rank of a peer in this rank's SP group (for ring P2P addressing)."""
        u = self.ulysses_rank if ulysses_rank is None else ulysses_rank
        return self.dp_rank * self.sp + (ring_rank % self.ring) * self.ulysses + u

    # ---- one interface with flex/bank.GroupBank: a mesh is a bank of one group size ------
    # What `patch()`, `batch_mesh`, the mixers and the trainer ask a bank, answered for the
    # one group size `sp`, so that every caller treats a mesh and a bank alike.
    @property
    def shapes(self) -> tuple[GroupShape, ...]:
        """The one group shape of this mesh: size sp, its Ulysses x ring split, its FPDT chunks."""
        return (GroupShape(size=self.sp, ulysses=self.ulysses, ring=self.ring, fpdt_chunks=self.fpdt_chunks),)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The one group size, `(sp,)` (a mesh is a bank of one size)."""
        return (self.sp,)

    @property
    def min_size(self) -> int:
        """The SP degree (the only group size)."""
        return self.sp

    @property
    def max_size(self) -> int:
        """The SP degree (the only group size)."""
        return self.sp

    def shape(self, size: int) -> GroupShape:
        """The group shape of `size`, which must be the SP degree."""
        if size != self.sp:
            raise ValueError(f"the mesh has no group of size {size}; its SP group has {self.sp} rank(s)")
        return self.shapes[0]

    def mesh(self, size: int) -> "SPMesh":
        """This rank's SP group of `size` ranks: this mesh (raises for any other size)."""
        self.shape(size)
        return self

    def group_index(self, size: int) -> int:
        """Index g of this rank's group of `size`: it covers ranks [g·size, (g+1)·size)."""
        self.shape(size)
        return self.dp_rank

    @property
    def world(self) -> "SPMesh":
        """The mesh for world-wide work (FSDP, the loss all-reduce): this one (DP x SP = the world)."""
        return self

    @property
    def patch_mesh(self) -> "SPMesh":
        """The mesh `patch()` validates options against: this one."""
        return self

    # ---- layout ------------------------------------------------------------------------
    @property
    def doc_multiple(self) -> int:
        """Every document's length must be a multiple of this (2R, or 1 without a ring)."""
        return layout.doc_multiple(self.ring)  # FPDT needs ring 1: 1 as well

    @property
    def seq_multiple(self) -> int:
        """The packed total length must be a multiple of this."""
        return layout.seq_multiple(self.ring, self.ulysses, self.fpdt_chunks)

    def check_boundaries(self, cu_seqlens: Sequence[int] | torch.Tensor) -> list[int]:
        """`cu_seqlens` as ints, checked (ValueError naming the documents): each a multiple of `doc_multiple`,
        the total of `seq_multiple`."""
        if isinstance(cu_seqlens, torch.Tensor):
            cu_seqlens = cu_seqlens.tolist()
        return layout.check_boundaries(cu_seqlens, self.ring, self.ulysses, self.fpdt_chunks)

    def local_runs(self, cu_seqlens: Sequence[int] | torch.Tensor) -> list[layout.Run]:
        """The runs of global positions this rank holds, in local order (`layout.local_runs`)."""
        cu = self.check_boundaries(cu_seqlens)
        return layout.local_runs(
            cu,
            ring=self.ring,
            ulysses=self.ulysses,
            ring_rank=self.ring_rank,
            ulysses_rank=self.ulysses_rank,
            fpdt_chunks=self.fpdt_chunks,
        )

    def local_indices(self, cu_seqlens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """int64 [S_local]: the global token positions this rank holds, in local order."""
        return layout.runs_to_indices(self.local_runs(cu_seqlens))


def process_group_world(what: str = "init_sequence_parallel") -> tuple[bool, int]:
    """(is the default process group initialised, its world size). Refuses a launch whose
    environment says several processes (WORLD_SIZE > 1, set by torchrun / accelerate launch)
    while no process group exists yet: a mesh built then would be a world of 1 on every rank,
    and each rank would train the whole step alone (silently: 1/WORLD_SIZE of the throughput)."""
    initialised = dist.is_available() and dist.is_initialized()
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if not initialised and launched > 1:
        raise NotSupported(
            f"{what}: the launcher started WORLD_SIZE={launched} processes but no torch.distributed process group "
            "exists yet, so the mesh would be a world of 1 on every rank (each rank training the whole step alone)",
            "create the process group first: build TrainingArguments(...) before the mesh (Accelerate initialises "
            "the group under torchrun / accelerate launch), or call torch.distributed.init_process_group() "
            "(backend 'nccl' on GPUs, 'gloo' on CPU)",
        )
    return initialised, (dist.get_world_size() if initialised else 1)


def init_sequence_parallel(ulysses_degree: int = 1, ring_degree: int = 1, fpdt_chunks: int = 1) -> SPMesh:
    """Build the frozen SP mesh over the default process group.

    `world = dp × ring × ulysses`; dp is what is left. Call it on every rank, after the
    process group exists (`torch.distributed.init_process_group`, or `TrainingArguments(...)`
    under a launcher); without a launcher (one process) no group is needed.

    Args:
        ulysses_degree: U, the Ulysses (all-to-all) degree: keep it within a node.
        ring_degree: R, the ring degree.
        fpdt_chunks: FPDT chunks per Ulysses all-to-all (needs ring_degree 1; 1: no FPDT).

    Returns:
        This rank's view of the mesh, with its process groups.

    Raises:
        ValueError: A degree is not a positive int, U × R does not divide the world size
            (every factor named), or FPDT chunks are asked with a ring.
        NotSupported: A launcher started WORLD_SIZE > 1 processes and no process group
            exists yet (`process_group_world`).
    """
    initialised, world = process_group_world("init_sequence_parallel")
    dp = check_degrees(world, ulysses_degree, ring_degree, fpdt_chunks)
    if not initialised:
        return SPMesh(dp=1, ring=1, ulysses=1, fpdt_chunks=fpdt_chunks, dp_rank=0, ring_rank=0, ulysses_rank=0)

    rank = dist.get_rank()
    sp = ulysses_degree * ring_degree
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    from torch.distributed.device_mesh import init_device_mesh

    # Every rank creates every group in the same order: group creation is itself collective.
    mesh3d = init_device_mesh(device_type, (dp, ring_degree, ulysses_degree), mesh_dim_names=("dp", "ring", "ulysses"))
    sp_mesh = mesh3d["ring", "ulysses"]._flatten("sp")  # [R·U] ranks of this SP group, ulysses fastest
    world_mesh = mesh3d._flatten("world")  # [dp·R·U]: FSDP shards over the whole world (USP Tip 3)
    return SPMesh(
        dp=dp,
        ring=ring_degree,
        ulysses=ulysses_degree,
        fpdt_chunks=fpdt_chunks,
        dp_rank=rank // sp,
        ring_rank=(rank % sp) // ulysses_degree,
        ulysses_rank=rank % ulysses_degree,
        device_mesh=mesh3d,
        world_mesh=world_mesh,
        ulysses_group=mesh3d.get_group("ulysses"),
        ring_group=mesh3d.get_group("ring"),
        sp_group=sp_mesh.get_group(),
        dp_group=mesh3d.get_group("dp"),
    )


def one_rank_world(mesh: SPMesh) -> SPMesh:
    """`mesh`, a world of one process, with a 1-D world mesh of one rank: what FSDP2 shards over
    when one process offloads its parameters (`fsdp_plan(..., param_offload=True)`), since
    `fully_shard` and DTensor need a process group even for one rank. Without a default process
    group (a script run without a launcher), one of one rank is created here -- gloo on CPU,
    NCCL on the current CUDA device -- over an in-process store (no address, no port); a group
    that exists (torchrun / accelerate launch with one process) is used as it is. A mesh that
    already has its world mesh is returned unchanged."""
    if mesh.world_mesh is not None:
        return mesh
    if mesh.world_size != 1:
        raise ValueError(f"a mesh of {mesh.world_size} ranks without a world mesh: build it with init_sequence_parallel")
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        dist.init_process_group(
            "nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
            device_id=torch.device("cuda", torch.cuda.current_device()) if cuda else None,
        )
    elif dist.get_world_size() != 1:
        raise ValueError(f"a mesh of one rank on a process group of {dist.get_world_size()}: build the mesh with "
                         "init_sequence_parallel after the process group exists")
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return replace(mesh, world_mesh=init_device_mesh(device_type, (1,), mesh_dim_names=("world",)))  # [1]: this rank
