"""Host offload of FPDT chunk tensors with double-buffered prefetch (FPDT paper §3.4).

Where it sits: `ops/fpdt.py` runs attention one sequence chunk at a time. Every chunk it
has finished with (K/V, and for the backward q, out, lse and the dq accumulator) goes into
a `ChunkStore`; when a later step needs chunk j again it asks the store, which copies it
back. `stream(keys)` walks a list of chunks with double buffering: the copy of chunk n+1
is started before chunk n is handed to the caller, so on CUDA the host-to-device copy runs
on a side stream while the caller's kernels run on the compute stream, and at most two
fetched chunks live on the device at once. A fetched device buffer is dropped as soon as
the caller moves past it.

On CUDA with `offload=True`: `put` copies to pinned host memory on the side stream (the
device tensor is marked as used by that stream, so the caching allocator cannot hand its
memory out before the copy ends), `prefetch` copies back on the side stream and records an
event, `get` makes the compute stream wait for that event. Waits sit only where a buffer
is reused: every `put` records an event after its device -> host copies, and the copy
that reads that host copy back (`prefetch`, in this store or in the backward's store that
`load`s it with the events from `written`) waits for it; the compute stream never waits
for a device -> host copy (nothing on it reads the host copies), so the end of a layer
does not stall on its offload. A device tensor being copied out is kept reserved for the
side stream (`keep_alive`); a host buffer handed back to the pool (`ops/host_pool.py`) is
only rewritten by a later copy on the same side stream, after every earlier one. Every
stream/event operation goes through `Streams` (`CudaStreams` on a GPU), so the exact
sequence of waits and records is tested on CPU with a fake (tests/unit/test_offload.py,
tests/unit/test_host_pool.py); what stays UNVERIFIED without a GPU is that the CUDA calls
themselves behave as documented. Everywhere else (CPU, or offload off) the store keeps
references and runs the same schedule without copies, so the schedule itself is tested on
CPU through `trace`.

`trace`, when given, receives ("put" | "fetch" | "release", key) and ("begin" | "end",
group) events in program order, plus the caller's own `note`s; `stream` records "begin" when it hands a group of chunks
to the caller and "end" when the caller asks for the next one, i.e. when the caller's
compute on it is done.
"""

from __future__ import annotations

import functools
from typing import Any, ContextManager, Hashable, Iterator, Protocol, Sequence

import torch

from hf_longctx._compat import empty_host_cache
from hf_longctx.ops.host_pool import HostPool

Key = Hashable


class Streams(Protocol):
    """The stream/event operations host offload needs (CUDA semantics). `CudaStreams` is the
    real one; tests pass a fake that records the calls and copies synchronously on CPU."""

    def offloads(self, device: torch.device) -> bool: ...  # does this device get host copies?
    def current(self, device: torch.device) -> Any: ...  # the compute stream
    def side(self, device: torch.device) -> Any: ...  # the copy stream (one per device)
    def on(self, stream: Any) -> ContextManager: ...  # make `stream` current
    def event(self) -> Any: ...  # .record(stream); stream.wait_event(event)
    def pinned(self, like: torch.Tensor) -> torch.Tensor: ...  # empty page-locked host tensor, like's strides
    def recycle(self, host: torch.Tensor) -> None: ...  # a `pinned` tensor its user is done with
    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None: ...  # tensor.record_stream


class CudaStreams:
    """`Streams` on CUDA: torch.cuda streams and events, pinned host memory from one
    `HostPool` (`ops/host_pool.py`); one side stream per device, created on first use."""

    def __init__(self) -> None:
        self._side: dict[torch.device, Any] = {}
        self.pool = HostPool()

    def offloads(self, device: torch.device) -> bool:
        return device.type == "cuda" and torch.cuda.is_available()

    def current(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def side(self, device: torch.device) -> Any:
        if device not in self._side:
            self._side[device] = torch.cuda.Stream(device)
        return self._side[device]

    def on(self, stream: Any) -> ContextManager:
        return torch.cuda.stream(stream)

    def event(self) -> Any:
        return torch.cuda.Event()

    def pinned(self, like: torch.Tensor) -> torch.Tensor:
        # like's own strides (preserve_format, for a dense tensor such as FPDT's head-major
        # views of token-major chunks): the copy is one memcpy, with no contiguous device copy first
        return self.pool.take(like)

    def recycle(self, host: torch.Tensor) -> None:
        self.pool.give(host)

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


@functools.cache
def default_streams() -> CudaStreams:
    """The process's one `CudaStreams`: every offload (FPDT chunk stores, checkpoint inputs
    in `integrations/checkpointing.py`) shares its one side stream per device, created on first
    use. A new `torch.cuda.Stream` per store would rotate through torch's pool of 32
    streams and spread prefetch buffers over as many caching-allocator pools. Pinned host
    buffers come from its one `HostPool`, reused per size class as stores hand them back;
    `release_pinned()` drops the free ones."""
    return CudaStreams()


def release_pinned() -> None:
    """Free the pinned host buffers kept for reuse -- the free ones of `default_streams()`'s
    pool, then the blocks torch's caching host allocator keeps (e.g. between benchmark
    probes of different lengths); buffers still in use stay."""
    default_streams().pool.clear()
    empty_host_cache()


class ChunkStore:
    """Chunk tensors keyed by the caller, held on host (offload on CUDA) or in place."""

    def __init__(
        self, device: torch.device | str, *, offload: bool, trace: list | None = None, streams: Streams | None = None
    ):
        self.device = torch.device(device)
        self._streams = default_streams() if streams is None else streams  # one side stream per device
        # Copies only pay off (and pinned memory only exists) with a CUDA device.
        self.copies = bool(offload) and self._streams.offloads(self.device)
        self.trace = trace
        self._held: dict[Key, tuple[torch.Tensor, ...]] = {}  # host copies, or the tensors themselves
        self._ready: dict[Key, tuple[tuple[torch.Tensor, ...], object]] = {}  # fetched: (device tensors, event)
        self._written: dict[Key, object] = {}  # key -> event recorded after its device -> host copies
        self._side = self._streams.side(self.device) if self.copies else None

    def note(self, event: str, key: Key) -> None:
        """Record an event of the caller's (e.g. the start of a pass) in the trace."""
        if self.trace is not None:
            self.trace.append((event, key))

    # ---- offload ------------------------------------------------------------------------
    def put(self, key: Key, *tensors: torch.Tensor) -> None:
        """Hand chunk tensors over; the caller may drop its references right after."""
        self.note("put", key)
        self._ready.pop(key, None)  # a stale device copy of an overwritten chunk (dq accumulators)
        self._recycle(key)  # its old host copy (copies into it are ordered on the side stream)
        if not self.copies:
            self._held[key] = tensors
            return
        main = self._streams.current(self.device)
        self._side.wait_stream(main)  # the tensors are produced by kernels already queued on main
        hosts = []
        with self._streams.on(self._side):
            for t in tensors:
                host = self._streams.pinned(t)
                host.copy_(t.detach(), non_blocking=True)  # [same shape] device -> pinned host, async on side
                self._streams.keep_alive(t, self._side)  # keep t's memory reserved until the copy has run
                hosts.append(host)
            written = self._streams.event()
            written.record(self._side)  # whoever reads these host copies waits for this, and only they
        self._held[key] = tuple(hosts)
        self._written[key] = written

    # ---- fetch --------------------------------------------------------------------------
    def prefetch(self, key: Key) -> None:
        """Start bringing a chunk back (no-op if it is already on its way)."""
        if key in self._ready:
            return
        if key not in self._held:
            raise KeyError(f"chunk {key!r} was never put into the store")
        self.note("fetch", key)
        if not self.copies:
            self._ready[key] = (self._held[key], None)
            return
        main = self._streams.current(self.device)
        # Waiting for main here only orders after work queued so far: the caller's compute
        # on the previous chunk is queued after this call, so it still overlaps the copy.
        self._side.wait_stream(main)
        written = self._written.get(key)
        if written is not None:  # the host copy is read here: after the copy that wrote it
            self._side.wait_event(written)
        with self._streams.on(self._side):
            devs = tuple(h.to(self.device, non_blocking=True) for h in self._held[key])  # pinned -> device
            event = self._streams.event()
            event.record(self._side)
        self._ready[key] = (devs, event)

    def get(self, key: Key) -> tuple[torch.Tensor, ...]:
        """The chunk's tensors on the device, usable on the current stream."""
        self.prefetch(key)
        devs, event = self._ready[key]
        if event is not None:
            main = self._streams.current(self.device)
            main.wait_event(event)
            for d in devs:
                self._streams.keep_alive(d, main)  # allocated on side, read on main: free only after main's use
        return devs

    def release(self, key: Key) -> None:
        """Drop the fetched device copy (the host copy stays for later passes)."""
        if self._ready.pop(key, None) is not None:
            self.note("release", key)

    def pop(self, key: Key) -> None:
        """Forget a chunk entirely; its host buffers go back to the pool."""
        self._ready.pop(key, None)
        self._recycle(key)

    def _recycle(self, key: Key) -> None:
        self._written.pop(key, None)
        held = self._held.pop(key, ())
        if self.copies:
            for host in held:
                self._streams.recycle(host)

    def stream(self, groups: Sequence[Sequence[Key]]) -> Iterator[tuple[tuple[Key, ...], list[torch.Tensor]]]:
        """Yield (group, device tensors of every key of the group, concatenated) in order,
        prefetching group n+1 before handing out group n (double buffering) and releasing
        group n when the caller moves on."""
        groups = [tuple(g) for g in groups]
        for key in groups[0] if groups else ():
            self.prefetch(key)
        for n, group in enumerate(groups):
            for key in groups[n + 1] if n + 1 < len(groups) else ():
                self.prefetch(key)
            tensors = [t for key in group for t in self.get(key)]
            self.note("begin", group)
            yield group, tensors
            self.note("end", group)
            del tensors
            for key in group:
                self.release(key)

    # ---- hand-over between forward and backward -----------------------------------------
    def finish(self) -> None:
        """Order every queued copy before later work on the compute stream (for a caller
        that reads host copies outside the store; the store itself never needs it)."""
        if self.copies:
            self._streams.current(self.device).wait_stream(self._side)

    def export(self, keys: Sequence[Key]) -> list[torch.Tensor]:
        """Flat list of the held tensors of `keys` (for `ctx.save_for_backward`). No wait:
        copies into them may still be in flight; pass `written(keys)` on to `load`."""
        return [t for key in keys for t in self._held[key]]

    def written(self, keys: Sequence[Key]) -> list:
        """Per key, the event after its device -> host copies (None: no copy), for `load`."""
        return [self._written.get(key) for key in keys]

    def load(self, keys: Sequence[Key], counts: Sequence[int], tensors: Sequence[torch.Tensor], written=None) -> None:
        """Inverse of `export`: hold `tensors` (already host copies when offloading) again;
        `written` (from `written(keys)`): the events their first read back waits for."""
        it = iter(tensors)
        for n, (key, count) in enumerate(zip(keys, counts)):
            self._held[key] = tuple(next(it) for _ in range(count))
            if written is not None and written[n] is not None:
                self._written[key] = written[n]

    def counts(self, keys: Sequence[Key]) -> list[int]:
        return [len(self._held[key]) for key in keys]
