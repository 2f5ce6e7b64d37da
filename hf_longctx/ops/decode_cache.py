"""The sequence-parallel KV cache of one rank: which tokens it holds, and their K/V per layer.

Where it sits: filled by the prefill (a patched forward over the packed prompts, sharded as a
training step by `shard_batch`) and grown by every decode step, through
`integrations/generation_binding.py`; read by `ops/decode_attention.py`. The rules:
- **Sharding**: a rank keeps the K/V of exactly the prompt tokens its shard holds (zigzag x
  Ulysses pieces, or FPDT's rank-ordinal pieces: `SPMesh.local_indices`), all KV heads, as the
  attention receives them (after RoPE, before any all-to-all). No gather of the cache, and no KV
  replication when H_kv < U. Padding tokens (document ends, the padding document) are dropped.
- **Owner**: completion token t of row n (fed at decode step t, position P_n + t) is appended on
  SP rank (n + t) mod SP. Per step each rank takes floor or ceil of N / SP of the new tokens; per
  row, every SP-th token: the shards stay within one token per row of each other.
The slots' rows and positions are fixed in advance by these rules (host arithmetic, the same on
every rank), so a decode step uploads nothing: it writes the owned rows' K/V into known slots.
Flash-decoding / decode context parallelism keep the cache split the same way (docs/DESIGN.md
"Generation is sequence-parallel too")."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Sequence

import torch


def owned_rows(step: int, rows: int, sp: int, sp_rank: int) -> list[int]:
    """The rows whose token fed at decode `step` is appended on `sp_rank`: n with (n + step) mod SP == sp_rank."""
    return [n for n in range(rows) if (n + step) % sp == sp_rank]


@dataclass(frozen=True)
class CacheLayout:
    """This rank's cache slots, in order: its real prompt tokens (local shard order), then the decoded
    tokens it owns, step by step. Host tensors; the same inputs give the same layout on every rank."""

    rows: int  # N
    sp: int
    sp_rank: int
    keep: torch.Tensor  # [P_real] long: local indices (shard order) of the real prompt tokens
    real_before: torch.Tensor  # [S_local + 1] long: real prompt tokens among the first i local tokens
    slot_rows: torch.Tensor  # [T] long: the row of every slot
    slot_pos: torch.Tensor  # [T] long: its position in the row
    step_base: tuple[int, ...]  # first slot of each decode step's appended tokens; step_base[t + 1] - step_base[t] tokens

    @property
    def capacity(self) -> int:
        return int(self.slot_rows.numel())


def cache_layout(
    prompt_lengths: Sequence[int], padded_cu: Sequence[int], local_indices: torch.Tensor, *, sp: int, sp_rank: int,
    max_new_tokens: int,
) -> CacheLayout:
    """The layout for prompts of `prompt_lengths` packed as documents 0..N-1 of one row whose padded
    boundaries are `padded_cu` (`shard_batch`'s; a trailing padding document may follow), of which this
    rank holds the global positions `local_indices` [S_local] in shard order. Decode steps
    0 .. max_new_tokens - 2 append (the last sampled token is never fed back)."""
    n = len(prompt_lengths)
    cu = [int(c) for c in padded_cu]
    if len(cu) < n + 1 or any(cu[i + 1] - cu[i] < p for i, p in enumerate(prompt_lengths)):
        raise ValueError(f"padded boundaries {cu[:8]}... do not hold the {n} prompts of lengths {list(prompt_lengths)[:8]}")
    g = local_indices.tolist()  # a host tensor (SPMesh.local_indices): once per rollout, no device sync
    docs = [bisect.bisect_right(cu, x) - 1 for x in g]
    real = [d < n and x - cu[d] < prompt_lengths[d] for x, d in zip(g, docs)]
    keep = [i for i, r in enumerate(real) if r]
    rows = [docs[i] for i in keep]
    pos = [g[i] - cu[docs[i]] for i in keep]
    real_before = [0]
    for r in real:
        real_before.append(real_before[-1] + r)
    base = [len(keep)]
    for t in range(max(0, max_new_tokens - 1)):
        mine = owned_rows(t, n, sp, sp_rank)
        rows.extend(mine)
        pos.extend(prompt_lengths[m] + t for m in mine)
        base.append(base[-1] + len(mine))
    long = dict(dtype=torch.long)
    return CacheLayout(n, sp, sp_rank, torch.tensor(keep, **long), torch.tensor(real_before, **long),
                       torch.tensor(rows, **long), torch.tensor(pos, **long), tuple(base))


class DecodeCache:
    """The K/V slots of every attention layer on this rank (allocated at the layer's first prefill
    write, in the dtype and head shape the attention gives), the slots' rows and positions on the
    device, and the owned-row index of each residue of the step modulo SP. `on_host`: the K/V slots
    live in page-locked host memory (`ops/host_pool.pinned_bytes`, exact size classes) and every
    write is an asynchronous copy into them; the decode kernel brings one chunk at a time to the
    device -- the cache a device cannot hold, at the price of reading it over PCIe every step."""

    def __init__(self, layout: CacheLayout, device: torch.device | str, on_host: bool = False) -> None:
        self.layout, self.device, self.on_host = layout, torch.device(device), on_host
        self._memory: list = []  # the page-locked buffers the host slots are views of
        self.slot_rows = layout.slot_rows.to(self.device, non_blocking=True)  # [T]
        self.slot_pos = layout.slot_pos.to(self.device, non_blocking=True)  # [T]
        self.keep = layout.keep.to(self.device, non_blocking=True)  # [P_real]: uploaded once, sliced per prefill write
        self.owned = [torch.tensor(owned_rows(r, layout.rows, layout.sp, layout.sp_rank), dtype=torch.long,
                                   device=self.device) for r in range(layout.sp)]  # the rule repeats with period SP
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [T, H_kv, D]
        self.values: dict[int, torch.Tensor] = {}
        self.cursor: dict[int, int] = {}  # layer -> local prompt rows written so far

    def _slots(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """Empty slots [T, H_kv, D] on the device, or page-locked on the host (plain host memory when the
        device is the CPU)."""
        if not self.on_host:
            return torch.empty(shape, dtype=dtype, device=self.device)
        from hf_longctx.ops.host_pool import pinned_bytes, plain_bytes

        nbytes = max(1, math.prod(shape) * dtype.itemsize)
        memory = pinned_bytes(nbytes) if self.device.type == "cuda" else plain_bytes(nbytes)
        self._memory.append(memory)
        return memory.data[: math.prod(shape) * dtype.itemsize].view(dtype).view(shape)  # [T, H_kv, D]

    def write_prompt(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The next local rows of `layer`'s prompt K/V ([S_rows, H_kv, D], in shard order: the whole
        shard, or a row chunk of it) into their slots; padding rows are skipped."""
        if layer not in self.keys:
            shape = (self.layout.capacity, *k.shape[1:])  # [T, H_kv, D]
            self.keys[layer], self.values[layer] = self._slots(shape, k.dtype), self._slots(shape, v.dtype)
            self.cursor[layer] = 0
        lo = self.cursor[layer]
        hi = lo + k.shape[0]
        if hi > self.layout.real_before.numel() - 1:
            raise RuntimeError(f"layer {layer} wrote {hi} prompt rows, but this rank's shard holds "
                               f"{self.layout.real_before.numel() - 1}")
        a, b = int(self.layout.real_before[lo]), int(self.layout.real_before[hi])  # slots of these rows
        if b > a:
            idx = self.keep[a:b] - lo  # [b - a] rows of this piece
            self.keys[layer][a:b].copy_(k.index_select(0, idx), non_blocking=True)  # host slots: an async copy
            self.values[layer][a:b].copy_(v.index_select(0, idx), non_blocking=True)
        self.cursor[layer] = hi

    def check_prompt(self, layers: int) -> None:
        """RuntimeError unless `layers` layers each received every local prompt row exactly once."""
        s_local = self.layout.real_before.numel() - 1
        wrong = {i: self.cursor.get(i, 0) for i in range(layers) if self.cursor.get(i, 0) != s_local}
        if wrong or len(self.keys) != layers:
            raise RuntimeError(f"the prefill wrote {len(self.keys)} layers' K/V ({wrong or 'all complete'}), expected "
                               f"{layers} layers of {s_local} local rows each: some attention call did not pass "
                               "through the sequence-parallel attention")

    def append(self, layer: int, step: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Decode `step`'s new K/V [N, H_kv, D] (every row, the same on every rank): this rank's owned
        rows into their slots. Returns the valid slots after the write."""
        a, b = self.layout.step_base[step], self.layout.step_base[step + 1]
        if b > a:
            idx = self.owned[step % self.layout.sp]  # [b - a]
            self.keys[layer][a:b].copy_(k.index_select(0, idx), non_blocking=True)
            self.values[layer][a:b].copy_(v.index_select(0, idx), non_blocking=True)
        return b
