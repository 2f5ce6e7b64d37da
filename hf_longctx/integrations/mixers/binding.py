"""What a mixer wrapper is (`MixerAdapter`) and the per-patch state every wrapper reads
(`MixerBinding`: the mesh, and the current batch's layout bound by the model-level
pre-forward hook of `patch()`). See the package docstring for the data flow."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from hf_longctx.data.sharding import SPBatchInfo
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.ops.mixers.layout import SequenceLayout


@dataclass(frozen=True)
class MixerAdapter:
    """scheme: how the mixer is sequence-parallel; `make` builds the instance's new forward
    (None = refused, with `reason`); `check` raises ValueError for a layout it cannot serve."""

    scheme: str
    make: Callable | None = None
    check: Callable | None = None
    reason: str = ""


class MixerBinding:
    """The per-patch state the wrappers read: the mesh and the current batch's layout."""

    def __init__(self, mesh: SPMesh):
        self.mesh = mesh
        self.group = mesh.sp_group if mesh.sp > 1 else None
        self.rank = mesh.sp_rank
        self.undo: list[Callable[[], None]] = []
        self.modules = 0  # wrapped mixer instances
        self.calls = 0  # wrapped mixer calls in the current forward
        self._info: SPBatchInfo | None = None
        self._layout: SequenceLayout | None = None

    def begin(self, info: SPBatchInfo) -> None:
        """Called by the model-level pre-forward hook with this forward's batch metadata."""
        if self._layout is None or self._layout.cu_seqlens != info.cu_seqlens:
            m = self.mesh
            self._layout = SequenceLayout(tuple(info.cu_seqlens), m.ring, m.ulysses, m.fpdt_chunks)
        self._info = info
        self.calls = 0

    def layout(self, module: Any, hidden_states: torch.Tensor) -> SequenceLayout:
        if self._info is None:
            raise RuntimeError(f"{type(module).__name__} ran outside a patched model forward: no batch metadata bound")
        if hidden_states.shape[0] != self._info.rows or hidden_states.shape[1] != self._layout.local_length:
            raise ValueError(
                f"{type(module).__name__} got hidden states {tuple(hidden_states.shape)} but the batch metadata describes "
                f"B = {self._info.rows} rows of S_local = {self._layout.local_length} tokens"
            )
        self.calls += 1
        return self._layout

    def check_calls(self) -> None:
        if self.calls != self.modules:
            raise RuntimeError(f"only {self.calls} of {self.modules} wrapped linear mixers ran in this forward")

    def restore(self) -> None:
        for fn in reversed(self.undo):
            fn()
        self.undo.clear()
