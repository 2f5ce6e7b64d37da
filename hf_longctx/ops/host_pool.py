"""Pinned host buffers reused per size class, one pool per `Streams` object (issue 19, item 3).

Where it sits: `ops/offload.CudaStreams.pinned(like)` takes the host side of every
device -> host copy of an offload here (FPDT chunk stores, `ops/offload.ChunkStore`), and
the store hands a buffer back (`give`) when it forgets the chunk. Without the pool every
copy asked torch's caching host allocator for a new block: it rounds each request up to a
power of two and keeps every block it ever handed out until `empty_host_cache()`, so a
run whose chunk sizes change (benchmark probes of growing length) pins ever more host
memory, and even a steady run calls into the allocator for every chunk of every layer.
Here a layer's buffers come back to the pool when its chunks are forgotten, and the next
layer (and the next step) takes the same buffers again: after the first step nothing new
is allocated. `clear()` (through `ops/offload.release_pinned()`) drops the free buffers.

Size classes are powers of two of bytes -- what torch's host allocator reserves for a
request anyway, so a class buffer wastes nothing beyond it. Free lists are kept per
device: every copy into or out of a buffer runs on that device's one side stream, so a
buffer handed back there is safe to reuse on the same stream without an event (stream
order); another device's side stream would need one.

A buffer is lent as a view `like`-shaped, with `like`'s strides when `like` is dense (a
head-major view of a token-major chunk copies as one memcpy, no contiguous device copy
first), contiguous otherwise.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch


def size_class(nbytes: int) -> int:
    """The smallest power of two >= nbytes (1 for an empty tensor)."""
    return 1 << max(0, int(nbytes) - 1).bit_length()


def pinned_bytes(nbytes: int) -> torch.Tensor:
    """A page-locked host buffer of `nbytes` bytes (uint8) from torch's host allocator."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _strides(like: torch.Tensor) -> tuple[int, ...]:
    """The strides torch gives `empty_like(like)` (preserve_format): like's own when it is
    dense and non-overlapping, contiguous otherwise. Computed on the meta device: no memory."""
    return torch.empty_like(like, device="meta").stride()


class HostPool:
    """Free pinned buffers per (device, size class); `alloc(nbytes)` makes new ones.

    `allocations` counts the buffers ever allocated (what the tests watch)."""

    def __init__(self, alloc: Callable[[int], torch.Tensor] = pinned_bytes):
        self._alloc = alloc
        self._free: dict[tuple[torch.device, int], list[torch.Tensor]] = {}
        # id(view) -> (weak view, buffer, device) while lent; an entry goes when its view dies
        # (a view never given back is simply freed: the pool holds no lent memory)
        self._lent: dict[int, tuple[weakref.ref, torch.Tensor, torch.device]] = {}
        self.allocations = 0

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised host tensor with like's shape, dtype (and dense strides), for a
        copy from `like` (a tensor on `like.device`)."""
        nbytes = like.numel() * like.element_size()
        key = (like.device, size_class(nbytes))
        free = self._free.get(key)
        if free:
            buf = free.pop()
        else:
            buf = self._alloc(key[1])  # [class bytes] uint8
            self.allocations += 1
        view = buf[:nbytes].view(like.dtype).as_strided(like.shape, _strides(like))  # like-shaped, on buf's memory
        self._lent[id(view)] = (weakref.ref(view), buf, like.device)
        weakref.finalize(view, self._lent.pop, id(view), None)
        return view

    def give(self, host: torch.Tensor) -> None:
        """Hand a tensor from `take` back (anything else is ignored: e.g. host tensors a
        store `load`ed from elsewhere). The caller must not use it afterwards; copies already
        queued on the side stream that read or write it stay ordered before its next use."""
        entry = self._lent.get(id(host))
        if entry is None or entry[0]() is not host:
            return
        del self._lent[id(host)]
        _, buf, device = entry
        self._free.setdefault((device, buf.numel()), []).append(buf)

    def clear(self) -> None:
        """Drop every free buffer (lent ones stay with their users)."""
        self._free.clear()

    def free_bytes(self) -> int:
        return sum(b.numel() for bufs in self._free.values() for b in bufs)
