"""Host offload of FPDT chunk tensors with double-buffered prefetch (FPDT paper §3.4).

Where it sits: `ops/fpdt.py` puts every chunk it has finished with (K/V; for the backward
q, out, lse and the dq accumulator) into a `ChunkStore` and gets it back when a later step
needs it; `stream(keys)` starts the copy of chunk n+1 before handing chunk n to the caller.
Guarantees: at most two fetched chunks live on the device; on CUDA with `offload=True` the
copies run on two side streams (device -> pinned host, host -> device), the compute stream
waits only for the copy it reads and never for an offload. Every stream/event operation
goes through `Streams`, so the exact schedule is tested on CPU with a fake; elsewhere the
store keeps references and runs the same schedule without copies (`trace` records it).
The stream and event rules: docs/DESIGN.md "The per-token memory budget"."""

from __future__ import annotations

import functools
from typing import Any, ContextManager, Hashable, Iterator, Protocol, Sequence

import torch

from hf_longctx._compat import empty_host_cache
from hf_longctx.ops.host_pool import HostPool

Key = Hashable


OUT, IN = "out", "in"  # copy directions: device -> host, host -> device (one side stream each)


class Streams(Protocol):
    """The stream/event operations host offload needs (CUDA semantics). `CudaStreams` is the
    real one; tests pass a fake that records the calls and copies synchronously on CPU."""

    def offloads(self, device: torch.device) -> bool: ...  # does this device get host copies?
    def is_host(self, tensor: torch.Tensor) -> bool: ...  # is this a host copy already (nothing to offload)?
    def current(self, device: torch.device) -> Any: ...  # the compute stream
    def side(self, device: torch.device, direction: str) -> Any: ...  # the OUT or IN copy stream of the device
    def on(self, stream: Any) -> ContextManager: ...  # make `stream` current
    def event(self) -> Any: ...  # .record(stream); stream.wait_event(event)
    def pinned(self, like: torch.Tensor) -> torch.Tensor: ...  # page-locked host tensor, like's strides; the
    # current stream (OUT) waits for the last copy of a reused buffer
    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor: ...  # async copy, current stream
    def note(self, host: torch.Tensor, event: Any, write: bool) -> None: ...  # `event` follows a copy into
    # (`write`) or out of a `pinned` tensor
    def pending(self, host: torch.Tensor) -> Any: ...  # the event after the last copy into a `pinned` tensor, or None
    def recycle(self, host: torch.Tensor) -> None: ...  # a `pinned` tensor its user is done with
    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None: ...  # tensor.record_stream


class CudaStreams:
    """`Streams` on CUDA: torch.cuda streams and events, pinned host memory from one
    `HostPool` (`ops/host_pool.py`); two side streams per device (one per direction),
    created on first use."""

    def __init__(self) -> None:
        self._side: dict[tuple[torch.device, str], Any] = {}
        self.pool = HostPool()

    def offloads(self, device: torch.device) -> bool:
        return device.type == "cuda" and torch.cuda.is_available()

    def is_host(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def current(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def side(self, device: torch.device, direction: str) -> Any:
        if (device, direction) not in self._side:
            self._side[device, direction] = torch.cuda.Stream(device)
        return self._side[device, direction]

    def on(self, stream: Any) -> ContextManager:
        return torch.cuda.stream(stream)

    def event(self) -> Any:
        return torch.cuda.Event()

    def pinned(self, like: torch.Tensor) -> torch.Tensor:
        # like's own strides (preserve_format, for a dense tensor such as FPDT's head-major
        # views of token-major chunks): the copy is one memcpy, with no contiguous device copy first
        host, last = self.pool.take(like)
        if last is not None:  # a reused buffer: its previous copy (a read back on the IN stream) comes first
            torch.cuda.current_stream(like.device).wait_event(last)
        return host

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return host.to(device, non_blocking=True)

    def note(self, host: torch.Tensor, event: Any, write: bool) -> None:
        self.pool.note(host, event, write)

    def pending(self, host: torch.Tensor) -> Any:
        return self.pool.pending(host)

    def recycle(self, host: torch.Tensor) -> None:
        self.pool.give(host)

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


@functools.cache
def default_streams() -> CudaStreams:
    """The process's one `CudaStreams`: every offload (FPDT chunk stores, checkpoint inputs
    in `integrations/checkpointing.py`, keep-attention) shares its two side streams per device,
    created on first use. New `torch.cuda.Stream`s per store would rotate through torch's pool
    of 32 streams and spread prefetch buffers over as many caching-allocator pools. Pinned host
    buffers come from its one `HostPool`, reused per size class as users hand them back;
    `release_pinned()` drops the free ones."""
    return CudaStreams()


def release_pinned() -> None:
    """Free the pinned host buffers kept for reuse -- the free ones of `default_streams()`'s
    pool, then the blocks torch's caching host allocator keeps (e.g. between benchmark
    probes of different lengths); buffers still in use stay."""
    default_streams().pool.clear()
    empty_host_cache()


def prepare_pinned(device: torch.device, tokens: int) -> int:
    """Before a micro-batch of `tokens` local tokens on `device` (the patch's pre-hook on the
    first decoder layer): pinned buffers for a micro-batch longer than every earlier one are
    registered now, scaled from those `default_streams()`'s pool holds, rather than inside
    its layers (`HostPool.prepare`). Returns the buffers registered (0 where nothing offloads)."""
    streams = default_streams()
    return streams.pool.prepare(device, tokens) if streams.offloads(device) else 0


def copy_out(streams: Streams, tensors: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], Any]:
    """Device -> pinned host copies of `tensors` (same device) on the device's OUT stream,
    after the kernels already queued on the compute stream that produce them: (host copies,
    the event recorded after them -- whoever reads a host copy waits for it, and only they).
    The device tensors stay reserved for the OUT stream until the copies have read them."""
    device = tensors[0].device
    main, out = streams.current(device), streams.side(device, OUT)
    out.wait_stream(main)  # the tensors are produced by kernels already queued on main
    hosts = []
    with streams.on(out):
        for t in tensors:
            host = streams.pinned(t)
            host.copy_(t.detach(), non_blocking=True)  # [same shape] device -> pinned host, async on OUT
            streams.keep_alive(t, out)  # the allocator must not reuse t's memory before the copy read it
            hosts.append(host)
        written = streams.event()
        written.record(out)
    for host in hosts:
        streams.note(host, written, write=True)
    return tuple(hosts), written


def copy_in(streams: Streams, hosts: Sequence[torch.Tensor], device: torch.device) -> tuple[tuple[torch.Tensor, ...], Any]:
    """Pinned host -> device copies on the device's IN stream, each after the copy that filled
    its host tensor (`Streams.pending`): (device copies, the event
    the compute stream waits for before reading them). Nothing else is waited for: a prefetch
    does not queue behind offloads or compute. The waits come from the host tensors
    themselves, so they stay right when a checkpoint's recompute refilled them."""
    inn = streams.side(device, IN)
    waited = []
    for h in hosts:
        written = streams.pending(h)
        if written is not None and all(written is not w for w in waited):
            inn.wait_event(written)
            waited.append(written)
    with streams.on(inn):
        devs = tuple(streams.to_device(h, device) for h in hosts)  # pinned -> device, async on IN
        ready = streams.event()
        ready.record(inn)
    main = streams.current(device)
    for d in devs:
        streams.keep_alive(d, main)  # allocated on IN, read on main: free only after main's use
    for h in hosts:
        streams.note(h, ready, write=False)  # a reused host buffer is rewritten only after this read
    return devs, ready


def _placeholder(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=t.dtype, device=device).expand(t.shape)  # t's shape, one element of memory


class ChunkStore:
    """Chunk tensors keyed by the caller, held on host (offload on CUDA) or in place."""

    def __init__(
        self, device: torch.device | str, *, offload: bool, trace: list | None = None, streams: Streams | None = None
    ):
        self.device = torch.device(device)
        self._streams = default_streams() if streams is None else streams  # two side streams per device
        # Copies only pay off (and pinned memory only exists) with a CUDA device.
        self.copies = bool(offload) and self._streams.offloads(self.device)
        self.trace = trace
        self._held: dict[Key, tuple[torch.Tensor, ...]] = {}  # host copies, or the tensors themselves
        self._ready: dict[Key, tuple[tuple[torch.Tensor, ...], object]] = {}  # fetched: (device tensors, event)

    def note(self, event: str, key: Key) -> None:
        """Record an event of the caller's (e.g. the start of a pass) in the trace."""
        if self.trace is not None:
            self.trace.append((event, key))

    # ---- offload ------------------------------------------------------------------------
    def put(self, key: Key, *tensors: torch.Tensor) -> None:
        """Hand chunk tensors over; the caller may drop its references right after."""
        self.note("put", key)
        self._ready.pop(key, None)  # a stale device copy of an overwritten chunk (dq accumulators)
        self._recycle(key)  # its old host copy (the pool orders the next copy into it after the last one)
        if not self.copies:
            self._held[key] = tensors
            return
        self._held[key], _ = copy_out(self._streams, tensors)

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
        self._ready[key] = copy_in(self._streams, self._held[key], self.device)

    def get(self, key: Key) -> tuple[torch.Tensor, ...]:
        """The chunk's tensors on the device, usable on the current stream."""
        self.prefetch(key)
        devs, event = self._ready[key]
        if event is not None:
            self._streams.current(self.device).wait_event(event)  # the copy back has landed
        return devs

    def release(self, key: Key) -> None:
        """Drop the fetched device copy (the host copy stays for later passes)."""
        if self._ready.pop(key, None) is not None:
            self.note("release", key)

    def put_placeholder(self, key: Key, *tensors: torch.Tensor) -> None:
        """Hold, instead of `tensors`, memory-free stand-ins with the metadata their held copies
        would have (shape, dtype, device: what a checkpoint's recompute is checked against)."""
        self.note("placeholder", key)
        host = torch.device("cpu") if self.copies else None
        self._held[key] = tuple(_placeholder(t, host or t.device) for t in tensors)

    def discard(self, key: Key) -> None:
        """`pop` the chunk, keeping placeholders of its held copies."""
        held = self._held[key]
        self.pop(key)
        self._held[key] = tuple(_placeholder(t, t.device) for t in held)

    def pop(self, key: Key) -> None:
        """Forget a chunk entirely; its host buffers go back to the pool."""
        self._ready.pop(key, None)
        self._recycle(key)

    def _recycle(self, key: Key) -> None:
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
            self._streams.current(self.device).wait_stream(self._streams.side(self.device, OUT))

    def export(self, keys: Sequence[Key]) -> list[torch.Tensor]:
        """Flat list of the held tensors of `keys` (for `ctx.save_for_backward`). No wait:
        copies into them may still be in flight; their first read back waits for them."""
        return [t for key in keys for t in self._held[key]]

    def load(self, keys: Sequence[Key], counts: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
        """Inverse of `export`: hold `tensors` (already host copies when offloading) again."""
        it = iter(tensors)
        for key, count in zip(keys, counts):
            self._held[key] = tuple(next(it) for _ in range(count))

    def counts(self, keys: Sequence[Key]) -> list[int]:
        return [len(self._held[key]) for key in keys]
