"""`Mesh`: what every consumer of a mesh asks it, whether it holds one SP group size or several.

Where it sits: the type of `patch(model, mesh)`'s mesh as it travels (`PatchState.bank`), of a
trainer's `mesh=` and of the checks on it. Two classes implement it: `SPMesh`
(`distributed/mesh.py`, a bank of its one group size) and `GroupBank` (`flex/bank.py`, one
aligned `SPMesh` per power-of-two size). Its members are exactly those the code reads through
a mesh of either kind: the world's size and this rank, the group shapes and sizes, this rank's
SP group of a size, the mesh of world-wide work (FSDP2, the loss all-reduce) and the mesh
`patch()` checks options against. What only one group answers (degrees, ranks, process groups,
the token layout) is `SPMesh`'s; what only a bank answers (`min_size`, `max_size`, `shape`) is
`GroupBank`'s, read where the code has told the two apart. `tests/unit/test_mesh.py` holds
both classes to this protocol.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.sp_groups import GroupShape


@runtime_checkable
class Mesh(Protocol):
    """A rank's view of its SP group(s): an `SPMesh` or a `GroupBank`."""

    @property
    def world_size(self) -> int:
        """Ranks in the world."""
        ...

    @property
    def rank(self) -> int:
        """This rank's global rank."""
        ...

    @property
    def shapes(self) -> tuple[GroupShape, ...]:
        """The group shapes, smallest first (one for an `SPMesh`)."""
        ...

    @property
    def sizes(self) -> tuple[int, ...]:
        """The group sizes, smallest first."""
        ...

    def mesh(self, size: int) -> SPMesh:
        """This rank's SP group of `size` ranks (raises for a size the mesh does not hold)."""
        ...

    @property
    def world(self) -> SPMesh:
        """The mesh of world-wide work: FSDP2 over every rank, the loss all-reduce."""
        ...

    @property
    def patch_mesh(self) -> SPMesh:
        """The mesh `patch()` checks options against and falls back to."""
        ...
