"""Pinned host buffers reused per size class, one pool per `Streams` object (FPDT §3.4 host offload).

Where it sits: `ops/offload.CudaStreams.pinned(like)` takes the host side of every
device -> host copy of an offload here (FPDT chunk stores, checkpointed layer inputs,
keep-attention's saved tensors); a buffer comes back when its user hands it over (`give`)
or when the tensor lent for it dies; `clear()` drops the free buffers.
Guarantees: a new buffer is at most 1/16 larger than its request (16 size classes per power
of two, page-locked at exactly that size with `cudaHostRegister`) and a free one serves requests
down to a quarter of it, so a step no longer than an earlier one allocates nothing; `reserve` /
`prepare` register a step's buffers before it runs; the pool never holds more than the most
it ever lent at once (`high_water`: one step's peak), a miss releasing free buffers first.
A buffer's next writer waits on the device for the event of its last copy, never on the
host. A lent view keeps `like`'s strides when `like` is dense.
Why not `pin_memory=True`: docs/DESIGN.md "Devices and kernels"."""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

SUBCLASSES = 16  # size classes per power of two: waste < 1 / SUBCLASSES of the request
# A free buffer serves requests down to 1/FIT of its size: a step down to a quarter of a longer
# one runs in its buffers, while a step's small tensors (an lse chunk: 1/D of its q chunk's
# elements) never take the large buffers of another kind.
FIT = 4


def size_class(nbytes: int) -> int:
    """The smallest class size >= nbytes: a multiple of 2^(k-4) for requests in (2^(k-1), 2^k]
    (16 classes per power of two), the request itself below 32 bytes (1 for an empty tensor)."""
    n = max(1, int(nbytes))
    step = max(1, (1 << (n - 1).bit_length()) // (2 * SUBCLASSES))
    return -(-n // step) * step


class _Registered:
    """A pageable host tensor page-locked with cudaHostRegister; unregistered when dropped."""

    def __init__(self, nbytes: int) -> None:
        self.data = torch.empty(nbytes, dtype=torch.uint8)  # [nbytes] from the CPU allocator: exact size
        cudart = torch.cuda.cudart()
        err = int(cudart.cudaHostRegister(self.data.data_ptr(), nbytes, 0))
        if err:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with cudaError {err} (host memory exhausted?)")
        self._unregister = weakref.finalize(self, cudart.cudaHostUnregister, self.data.data_ptr())


def pinned_bytes(nbytes: int) -> Any:
    """A page-locked host buffer of exactly `nbytes` bytes: an object whose `.data` is the
    uint8 tensor. cudaHostRegister where this torch build has it (CUDA); else torch's pinned
    allocator (which rounds to a power of two)."""
    cudart = torch.cuda.cudart() if torch.cuda.is_available() else None
    if cudart is not None and hasattr(cudart, "cudaHostRegister"):
        return _Registered(nbytes)
    return _Plain(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))


class _Plain:
    """A buffer without registration (torch's pinned allocator, or plain memory in tests)."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data


def plain_bytes(nbytes: int) -> _Plain:
    """Unpinned host bytes: the allocator tests and CPU emulations pass to `HostPool`."""
    return _Plain(torch.empty(nbytes, dtype=torch.uint8))


def _strides(like: torch.Tensor) -> tuple[int, ...]:
    """The strides torch gives `empty_like(like)` (preserve_format): like's own when it is
    dense and non-overlapping, contiguous otherwise. Computed on the meta device: no memory."""
    return torch.empty_like(like, device="meta").stride()


class _Buffer:
    """One pool buffer: its memory, its class, and the event of the last copy that touched it."""

    def __init__(self, mem: Any, device: torch.device) -> None:
        self.mem, self.device = mem, device
        self.last = None  # event after the last copy of any kind: the next writer waits for it
        self.written = None  # event after the last copy INTO it: a reader waits for it

    @property
    def nbytes(self) -> int:
        return self.mem.data.numel()


def _done(event: Any) -> bool:
    """Has the copy behind `event` finished? Asked without waiting (cudaEventQuery)."""
    return event is None or event.query()


class HostPool:
    """Free pinned buffers per (device, size class); `alloc(nbytes)` makes new ones.

    `allocations` counts the buffers ever allocated (registered) and `allocated_bytes` their
    bytes, `releases` / `released_bytes` those dropped to stay within `high_water`, the most
    bytes lent at once (what the tests watch)."""

    def __init__(self, alloc: Callable[[int], Any] = pinned_bytes):
        self._alloc = alloc
        self._free: dict[tuple[torch.device, int], list[_Buffer]] = {}
        # id(view) -> (weak view, buffer, finalizer) while lent
        self._lent: dict[int, tuple[weakref.ref, _Buffer, Any]] = {}
        self.allocations = 0
        self.allocated_bytes = 0
        self.releases = 0
        self.released_bytes = 0
        self.high_water = 0  # the most bytes lent at once: the bound on what the pool holds
        self.tokens = 0  # the longest micro-batch `prepare` was told of
        self.current = 0  # the micro-batch `prepare` was told of last
        self._lent_total = 0

    def take(self, like: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """(an uninitialised host tensor with like's shape, dtype and dense strides, for a copy
        from `like` on `like.device`; the event the copy must wait for before writing into it,
        or None)."""
        nbytes = like.numel() * like.element_size()
        buf = self._reuse(like.device, size_class(nbytes), nbytes) or self._new(like.device, size_class(nbytes))
        self._lent_total += buf.nbytes
        self.high_water = max(self.high_water, self._lent_total)
        view = buf.mem.data[:nbytes].view(like.dtype).as_strided(like.shape, _strides(like))  # like-shaped
        # A view that dies without `give` still brings its buffer back (with its last event).
        fin = weakref.finalize(view, self._returned, id(view))
        self._lent[id(view)] = (weakref.ref(view), buf, fin)
        return view, buf.last

    def _entry(self, host: torch.Tensor) -> tuple | None:
        entry = self._lent.get(id(host))
        return entry if entry is not None and entry[0]() is host else None

    def note(self, host: torch.Tensor, event: Any, write: bool) -> None:
        """`event` is recorded after a copy that writes (`write`) or reads `host` (a lent
        tensor; others are ignored)."""
        entry = self._entry(host)
        if entry is not None:
            entry[1].last = event
            if write:
                entry[1].written = event

    def owns(self, host: torch.Tensor) -> bool:
        """Is `host` a tensor this pool lent (and not yet got back)?"""
        return self._entry(host) is not None

    def pending(self, host: torch.Tensor) -> Any:
        """The event after the last copy into `host` (a lent tensor), or None: what a read waits for."""
        entry = self._entry(host)
        return None if entry is None else entry[1].written

    def give(self, host: torch.Tensor, read: Any = None) -> None:
        """Hand a tensor from `take` back (anything else is ignored: e.g. host tensors a store
        `load`ed from elsewhere). `read`: the event after its last read back, if not noted
        yet. The caller must not use it afterwards."""
        entry = self._entry(host)
        if entry is None:
            return
        _, buf, fin = self._lent.pop(id(host))
        fin.detach()
        self._lent_total -= buf.nbytes
        if read is not None:
            buf.last = read
        buf.written = None
        self._free.setdefault((buf.device, buf.nbytes), []).append(buf)

    def _returned(self, key: int) -> None:
        entry = self._lent.pop(key, None)
        if entry is not None:
            buf = entry[1]
            self._lent_total -= buf.nbytes
            self._free.setdefault((buf.device, buf.nbytes), []).append(buf)

    def clear(self) -> None:
        """Release every free buffer (lent ones stay with their users), each after its last copy."""
        for bufs in self._free.values():
            for buf in bufs:
                if buf.last is not None:
                    buf.last.synchronize()
        self._free.clear()

    def free_bytes(self) -> int:
        return sum(b.nbytes for bufs in self._free.values() for b in bufs)

    def lent_bytes(self) -> int:
        return sum(entry[1].nbytes for entry in self._lent.values())

    # ---- bounded growth: reuse across lengths, release on a miss, registration before a step ----
    def _reuse(self, device: torch.device, cls: int, nbytes: int | None = None) -> _Buffer | None:
        """A free buffer for a request of class `cls` (`nbytes`): one of that class, else the
        smallest larger one up to FIT x. In a micro-batch shorter than the longest (`prepare`),
        the class the same tensor had in the longest goes first, both ways: a shorter step runs
        in the longest one's buffers as that one did, not in those of another tensor that is
        of this one's size."""
        classes = [cls]
        if nbytes is not None and 0 < self.current < self.tokens:
            classes.insert(0, size_class(-(-nbytes * self.tokens // self.current)))
        for c in classes:
            if self._free.get((device, c)):
                return self._free[device, c].pop()
        for c in classes:
            fits = [key for key, bufs in self._free.items() if bufs and key[0] == device and c < key[1] <= FIT * c]
            if fits:
                return self._free[min(fits, key=lambda key: key[1])].pop()
        return None

    def _new(self, device: torch.device, cls: int) -> _Buffer:
        """A new buffer of `cls` bytes (registered now), free ones released first so that lent +
        free + it stays within the high-water mark of lent bytes (raised by it if need be)."""
        self.high_water = max(self.high_water, self._lent_total + cls)
        self._trim(self.high_water - self._lent_total - cls)
        self.allocations += 1
        self.allocated_bytes += cls
        return _Buffer(self._alloc(cls), device)  # [cls bytes] uint8

    def _trim(self, limit: int) -> None:
        """Release free buffers, smallest first (a larger one serves more requests), until at
        most `limit` bytes are free. Only those whose last copy is done (asked, not waited
        for: no host sync inside a step); the others stay, to go at a later miss or `clear()`."""
        excess = self.free_bytes() - limit
        for key in sorted(self._free, key=lambda key: key[1]):
            if excess <= 0:
                return
            kept = []
            for buf in self._free[key]:
                if excess > 0 and _done(buf.last):
                    excess -= buf.nbytes
                    self.releases += 1
                    self.released_bytes += buf.nbytes  # dropped: unregistered by its finalizer
                else:
                    kept.append(buf)
            self._free[key] = kept

    def reserve(self, byte_sizes, device) -> int:
        """Hold free buffers on `device` for requests of `byte_sizes` -- a step's, registered now
        instead of inside its layers: free buffers of their size classes are kept, the missing ones
        allocated, and free ones beyond the bound (raised to lent + the reservation) released.
        Returns the buffers allocated."""
        device = torch.device(device)
        classes = sorted((size_class(n) for n in byte_sizes), reverse=True)
        kept = [self._free[device, c].pop() if self._free.get((device, c)) else None for c in classes]  # exact only
        missing = [c for c, buf in zip(classes, kept) if buf is None]
        kept = [buf for buf in kept if buf is not None]
        total = sum(buf.nbytes for buf in kept) + sum(missing)
        self.high_water = max(self.high_water, self._lent_total + total)
        self._trim(self.high_water - self._lent_total - total)
        for c in missing:
            self.allocations += 1
            self.allocated_bytes += c
            kept.append(_Buffer(self._alloc(c), device))
        for buf in kept:
            self._free.setdefault((device, buf.nbytes), []).append(buf)
        return len(missing)

    def prepare(self, device, tokens: int) -> int:
        """Before a micro-batch of `tokens` tokens on `device`: if it is longer than every one
        before, the buffers held on `device` -- sized by the longest so far, each linear in its
        tokens -- are reserved scaled to it, now, not inside its layers. Returns the buffers
        allocated (0 for the first micro-batch, which sizes them)."""
        device = torch.device(device)
        before, self.tokens, self.current = self.tokens, max(self.tokens, tokens), tokens
        if not before or tokens <= before:
            return 0
        held = [b.nbytes for (d, _), bufs in self._free.items() if d == device for b in bufs]
        held += [entry[1].nbytes for entry in self._lent.values() if entry[1].device == device]
        return self.reserve([-(-n * tokens // before) for n in held], device)
