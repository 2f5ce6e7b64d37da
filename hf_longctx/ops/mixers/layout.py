"""Where every token of a packed batch lives across the SP group, for the linear mixers.

Where it sits: built once per batch (cached by `integrations/mixers/`) from the GLOBAL
document boundaries and the mesh degrees with the same pure functions as `shard_batch`
(`hf_longctx/layout.py`). It answers, for any rank: the global positions each SP rank holds,
the permutation from concatenated shards to global order, each position's document start,
and a convolution's halo (which of the K-1 previous positions of the same document to
fetch, and from whom).
Guarantees: pure Python + index tensors, the same on every rank (invariant 8), so receives
are sized locally; index tensors reach the device once per layout through `on_device`
(pinned, non-blocking): no synchronous host copy inside a mixer layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Hashable

import torch

from hf_longctx import layout
from hf_longctx.devices import to_device


@dataclass(frozen=True, eq=False)
class SequenceLayout:
    """The token placement of one batch row layout over an SP group of `ring × ulysses` ranks.

    SP rank p = ring_rank · U + ulysses_rank, the rank order of `SPMesh.sp_group`."""

    cu_seqlens: tuple[int, ...]
    ring: int
    ulysses: int
    fpdt_chunks: int = 1
    _halo: dict = field(default_factory=dict, repr=False)
    _plans: dict = field(default_factory=dict, repr=False)  # state-passing plans (ops/mixers/state_passing.py)
    _device: dict = field(default_factory=dict, repr=False)

    def on_device(self, key: Hashable, device: torch.device, build: Callable[[], Any]) -> Any:
        """`build()` -- a host index tensor, or a list / tuple of them -- on `device`, built and
        uploaded once per (key, device) for the lifetime of this layout (one batch layout):
        every mixer layer of the batch, forward, recomputation and backward, reuses the copy."""
        k = (key, str(device))
        if k not in self._device:
            self._device[k] = to_device(build(), device)  # pinned staging on CUDA: the host never waits
        return self._device[k]

    def memo(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """`build()` once per key for the lifetime of this layout (derived plans with their own
        device tensors, e.g. `ragged.PaddedSpans`)."""
        if key not in self._device:
            self._device[key] = build()
        return self._device[key]

    @property
    def sp(self) -> int:
        return self.ring * self.ulysses

    @property
    def total(self) -> int:
        return self.cu_seqlens[-1]

    @cached_property
    def runs(self) -> list[list[layout.Run]]:
        """[SP] x runs (consecutive global positions of one document) of every SP rank, local order."""
        cu = layout.check_boundaries(self.cu_seqlens, self.ring, self.ulysses, self.fpdt_chunks)
        return [
            layout.local_runs(
                cu, ring=self.ring, ulysses=self.ulysses, ring_rank=p // self.ulysses, ulysses_rank=p % self.ulysses,
                fpdt_chunks=self.fpdt_chunks,
            )
            for p in range(self.sp)
        ]

    @cached_property
    def indices(self) -> list[torch.Tensor]:
        """[SP] x int64 [S_local]: global positions of every SP rank, in its local order."""
        return [layout.runs_to_indices(runs) for runs in self.runs]

    @property
    def local_length(self) -> int:
        return self.total // self.sp

    @cached_property
    def source_order(self) -> torch.Tensor:
        """int64 [S]: global position of row i of the rank-by-rank concatenation of the shards."""
        return torch.cat(self.indices)

    @cached_property
    def to_global(self) -> torch.Tensor:
        """int64 [S]: gather with it to turn the rank-by-rank concatenation into global order."""
        return torch.argsort(self.source_order)

    @cached_property
    def doc_start(self) -> torch.Tensor:
        """int64 [S]: first global position of the document holding each global position."""
        cu = torch.tensor(self.cu_seqlens, dtype=torch.long)
        lengths = cu[1:] - cu[:-1]
        return torch.repeat_interleave(cu[:-1], lengths)  # [S]

    @cached_property
    def _owner(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rank [S], local row [S]) of every global position."""
        rank = torch.empty(self.total, dtype=torch.long)
        row = torch.empty(self.total, dtype=torch.long)
        for p, idx in enumerate(self.indices):
            rank[idx] = p
            row[idx] = torch.arange(idx.numel())
        return rank, row

    def taps(self, positions: torch.Tensor, kernel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global positions read by a causal convolution of `kernel` taps, and their validity.

        Returns (pos [N, K], valid [N, K]): tap j of token t reads position t - (K-1-j), as
        `F.conv1d(padding=K-1)[..., :L]` does; taps before the token's document start are
        invalid (they read the zero padding of a per-document run)."""
        shifts = torch.arange(kernel - 1, -1, -1, dtype=torch.long)  # [K]: K-1 ... 0
        pos = positions[:, None] - shifts[None, :]  # [N, K]
        valid = pos >= self.doc_start[positions][:, None]  # [N, K]
        return pos.clamp_min(0), valid

    def doc_segments(self, kernel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For a convolution over the WHOLE sequence (global order) with a zero row appended at
        index S: (seg_rows [S + n_docs·(K-1)], out_index [S]). seg_rows puts K-1 zero rows in
        front of every document, so one unpadded `conv1d` over it never reads across a document
        boundary; out_index picks the output of every token (t + d·(K-1) for document d)."""
        key = ("docs", kernel)
        if key not in self._halo:
            parts, out = [], []
            for d, (a, b) in enumerate(zip(self.cu_seqlens[:-1], self.cu_seqlens[1:])):
                parts += [torch.full((kernel - 1,), self.total, dtype=torch.long), torch.arange(a, b)]
                out.append(torch.arange(a, b) + d * (kernel - 1))
            self._halo[key] = (torch.cat(parts), torch.cat(out))
        return self._halo[key]

    def halo(self, kernel: int) -> "HaloPlan":
        """The halo exchange of a causal convolution with `kernel` taps (cached per kernel)."""
        plan = self._halo.get(kernel)
        if plan is None:
            plan = self._halo[kernel] = HaloPlan.build(self, kernel)
        return plan


@dataclass(frozen=True)
class HaloPlan:
    """Who sends which rows to whom so that every rank can run a causal convolution of
    kernel K on its own shard: the K-1 previous positions of the same document that the
    rank does not hold itself.

    send_rows[p][q]: local rows rank p sends to rank q (in q's receive order);
    recv_counts[p][q]: rows rank p receives from rank q (= len(send_rows[q][p]));
    tap_rows[p]: int64 [S_local, K] rows of rank p's extended tensor
    cat([own shard, received halo (by source rank), one zero row]) each tap reads;
    seg_rows[p], out_index[p]: the same as segments for one unpadded `conv1d`: every local run
    preceded by the K-1 rows before its start (halo, own or zero rows), and where each local
    token's output lands (see `SequenceLayout.doc_segments`)."""

    kernel: int
    send_rows: list
    recv_counts: list
    tap_rows: list
    seg_rows: list
    out_index: list

    @staticmethod
    def build(lay: SequenceLayout, kernel: int) -> "HaloPlan":
        owner_rank, owner_row = lay._owner
        sp, s_local = lay.sp, lay.local_length
        send_rows = [[torch.empty(0, dtype=torch.long) for _ in range(sp)] for _ in range(sp)]
        recv_counts = [[0] * sp for _ in range(sp)]
        tap_rows, seg_rows, out_index = [], [], []
        for p, idx in enumerate(lay.indices):
            pos, valid = lay.taps(idx, kernel)  # [S_local, K]
            src = owner_rank[pos]  # [S_local, K]
            remote = valid & (src != p)
            rows = torch.where(valid & (src == p), owner_row[pos], torch.full_like(pos, -1))  # own rows
            need = torch.unique(pos[remote])  # sorted global positions fetched by p
            need_src = owner_rank[need]
            offset = s_local
            halo_row = torch.full((lay.total,), -1, dtype=torch.long)
            for q in range(sp):
                from_q = need[need_src == q]  # sorted
                send_rows[q][p] = owner_row[from_q]
                recv_counts[p][q] = int(from_q.numel())
                halo_row[from_q] = torch.arange(offset, offset + from_q.numel())
                offset += from_q.numel()
            rows = torch.where(remote, halo_row[pos], rows)
            zero_row = offset  # the appended zero row: invalid taps read it
            taps = torch.where(valid, rows, torch.full_like(rows, zero_row))  # [S_local, K]
            tap_rows.append(taps)
            segs, outs, local, seg = [], [], 0, 0
            for run in lay.runs[p]:
                segs += [taps[local, : kernel - 1], torch.arange(local, local + run.length)]
                outs.append(torch.arange(seg, seg + run.length))
                local, seg = local + run.length, seg + run.length + kernel - 1
            seg_rows.append(torch.cat(segs))
            out_index.append(torch.cat(outs))
        return HaloPlan(kernel, send_rows, recv_counts, tap_rows, seg_rows, out_index)
