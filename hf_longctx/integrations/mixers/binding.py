"""What a mixer wrapper is (`MixerAdapter`) and the per-patch state every wrapper reads
(`MixerBinding`: the SP group of the current batch -- fixed, or the batch's group of a
GroupBank --, its layout bound by the model-level pre-forward hook of `patch()`, and the
scheme of every recurrence for this batch). See the package docstring for the data flow."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from hf_longctx.sp_groups import default_ranks_per_node
from hf_longctx.data.sharding import SPBatchInfo
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.capacity.mixers import mixer_links
from hf_longctx.integrations.mixers.modes import mixer_dims
from hf_longctx.ops.mixers.cost import busiest_state_traffic, choose, head_traffic
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
    """The per-patch state the wrappers read: the batch's mesh, layout and schemes.

    `resolve(info)` gives the batch's SPMesh (the patch mesh, or the batch's group of a
    GroupBank); `modes` maps a recurrence's class name to "auto" | "heads" | "state"."""

    def __init__(self, mesh: SPMesh, resolve: Callable[[SPBatchInfo], SPMesh] | None = None, modes: dict | None = None):
        self.resolve = resolve or (lambda info: mesh)
        self.modes = modes or {}
        self.undo: list[Callable[[], None]] = []
        self.modules = 0  # wrapped mixer instances
        self.calls = 0  # wrapped mixer calls in the current forward
        self.ran: dict[str, dict[int, str]] = {}  # class name -> {SP group size: the scheme it last ran with}
        self._info: SPBatchInfo | None = None
        self._layout: SequenceLayout | None = None
        self._batch_mesh = mesh
        self._decisions: dict = {}
        self._splits: dict = {}

    @property
    def group(self):
        return self._batch_mesh.sp_group if self._batch_mesh.sp > 1 else None

    @property
    def rank(self) -> int:
        return self._batch_mesh.sp_rank

    def begin(self, info: SPBatchInfo) -> None:
        """Called by the model-level pre-forward hook with this forward's batch metadata."""
        m = self.resolve(info)
        key = (tuple(info.cu_seqlens), m.ring, m.ulysses, m.fpdt_chunks)
        if self._layout is None or (self._layout.cu_seqlens, self._layout.ring, self._layout.ulysses,
                                    self._layout.fpdt_chunks) != key:
            self._layout = SequenceLayout(*key)
            self._decisions.clear()
        self._batch_mesh = m
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

    def split(self, module: Any, build: Callable[[int], Any]) -> Any:
        """The head split of `module`'s class over this batch's group (built once per size)."""
        key = (type(module), self._layout.sp)
        if key not in self._splits:
            self._splits[key] = build(self._layout.sp)
        return self._splits[key]

    def scheme(self, module: Any, dtype: torch.dtype) -> str:
        """"heads" or "state" for `module` in this batch: the patch option, or the cost rule
        (`ops/mixers/cost.choose`) on this batch's layout -- the slowest rank's state-passing
        traffic against the head all-to-all's, identical on every rank."""
        name = type(module).__name__
        mode = self.modes.get(name, "auto")
        if mode == "auto":
            dims = mixer_dims(module)
            key = (dims, dtype)
            if key not in self._decisions:
                self._decisions[key] = self._choose(dims, torch.empty((), dtype=dtype).element_size())
            mode = self._decisions[key]
        self.ran.setdefault(name, {})[self._layout.sp] = mode
        return mode

    def _choose(self, dims, elem: int) -> str:
        lay, rows = self._layout, self._info.rows
        if lay.sp == 1:
            return "heads"  # nothing crosses ranks: the per-document path without extra state columns
        heads = head_traffic(dims, lay.sp, lay.local_length, elem, rows)
        state = busiest_state_traffic(dims, lay, elem, rows)  # forward and reverse scans, halo both ways
        links = mixer_links(lay.sp, default_ranks_per_node(self._batch_mesh.world_size))
        return choose(dims, lay.sp, heads, state, links)

    def check_calls(self) -> None:
        if self.calls != self.modules:
            raise RuntimeError(f"only {self.calls} of {self.modules} wrapped linear mixers ran in this forward")

    def restore(self) -> None:
        for fn in reversed(self.undo):
            fn()
        self.undo.clear()
