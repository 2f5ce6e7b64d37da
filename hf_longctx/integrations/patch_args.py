"""The arguments `patch()` takes, checked and resolved before anything reads the model.

Where it sits: at the entry of `integrations/model_patch.patch` (and, for the mesh, of the
trainer). Guarantees: the mesh argument is an `SPMesh` or a `GroupBank` (otherwise a
`TypeError` naming both constructors); a memory knob the caller did not pass (`UNSET`) is told
apart from one passed with its default value, so `PatchOptions.resolve` (`config.py`) refuses
a preset and a knob together."""

from __future__ import annotations

from typing import Any

from hf_longctx.config import PatchOptions
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.flex.bank import GroupBank


def check_mesh(mesh: object) -> None:
    """The type check of the entry points that take either (`patch()`, the trainer): an SPMesh
    or a GroupBank; past it they ask both the same questions."""
    if not isinstance(mesh, (SPMesh, GroupBank)):
        raise TypeError(
            "mesh must be an SPMesh from hf_longctx.init_sequence_parallel or a GroupBank from "
            f"hf_longctx.init_group_bank, got {type(mesh).__name__}"
        )


class _Unset:
    """A knob the caller did not pass (memory= and a knob together is an error); `help(patch)`
    shows it as `unset` rather than an object address."""

    def __repr__(self) -> str:
        return "unset"


UNSET: Any = _Unset()


def resolve_options(
    memory: str | None, knobs: dict, mesh: SPMesh, inputs_on_device: int, keep_attention: bool = False,
    fused: bool = False, loss_chunk_rows: int | None = None, attention_backend: str | None = None,
) -> tuple[PatchOptions, frozenset]:
    """`patch()`'s options from the preset and the knobs the caller passed (those not `UNSET`),
    and the names of those knobs."""
    given = {k: v for k, v in knobs.items() if v is not UNSET}
    options = PatchOptions.resolve(memory, given, mesh.fpdt_chunks, inputs_on_device, keep_attention, fused=fused,
                                   loss_chunk_rows=loss_chunk_rows, attention_backend=attention_backend)
    return options, frozenset(given)
