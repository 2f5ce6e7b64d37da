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
event, `get` makes the compute stream wait for that event. This branch is UNVERIFIED: no
GPU was available when it was written. Everywhere else (CPU, or offload off) the store keeps
references and runs the same schedule without copies, so the schedule itself is tested on
CPU through `trace`.

`trace`, when given, receives ("put" | "fetch" | "release", key) and ("begin" | "end",
group) events in program order, plus the caller's own `note`s; `stream` records "begin" when it hands a group of chunks
to the caller and "end" when the caller asks for the next one, i.e. when the caller's
compute on it is done.
"""

from __future__ import annotations

from typing import Hashable, Iterator, Sequence

import torch

Key = Hashable


class ChunkStore:
    """Chunk tensors keyed by the caller, held on host (offload on CUDA) or in place."""

    def __init__(self, device: torch.device | str, *, offload: bool, trace: list | None = None):
        self.device = torch.device(device)
        # Copies only pay off (and pinned memory only exists) with a CUDA device.
        self.copies = bool(offload) and self.device.type == "cuda" and torch.cuda.is_available()
        self.trace = trace
        self._held: dict[Key, tuple[torch.Tensor, ...]] = {}  # host copies, or the tensors themselves
        self._ready: dict[Key, tuple[tuple[torch.Tensor, ...], object]] = {}  # fetched: (device tensors, event)
        self._side = torch.cuda.Stream(self.device) if self.copies else None

    def note(self, event: str, key: Key) -> None:
        """Record an event of the caller's (e.g. the start of a pass) in the trace."""
        if self.trace is not None:
            self.trace.append((event, key))

    # ---- offload ------------------------------------------------------------------------
    def put(self, key: Key, *tensors: torch.Tensor) -> None:
        """Hand chunk tensors over; the caller may drop its references right after."""
        self.note("put", key)
        self._ready.pop(key, None)  # a stale device copy of an overwritten chunk (dq accumulators)
        if not self.copies:
            self._held[key] = tensors
            return
        main = torch.cuda.current_stream(self.device)
        self._side.wait_stream(main)  # the tensors are produced by kernels already queued on main
        hosts = []
        with torch.cuda.stream(self._side):
            for t in tensors:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)  # [same shape] device -> pinned host, async on side
                t.record_stream(self._side)  # keep t's memory reserved until the copy has run
                hosts.append(host)
        self._held[key] = tuple(hosts)

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
        main = torch.cuda.current_stream(self.device)
        # Waiting for main here only orders after work queued so far: the caller's compute
        # on the previous chunk is queued after this call, so it still overlaps the copy.
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            devs = tuple(h.to(self.device, non_blocking=True) for h in self._held[key])  # pinned -> device
            event = torch.cuda.Event()
            event.record(self._side)
        self._ready[key] = (devs, event)

    def get(self, key: Key) -> tuple[torch.Tensor, ...]:
        """The chunk's tensors on the device, usable on the current stream."""
        self.prefetch(key)
        devs, event = self._ready[key]
        if event is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_event(event)
            for d in devs:
                d.record_stream(main)  # allocated on side, read on main: free only after main's use
        return devs

    def release(self, key: Key) -> None:
        """Drop the fetched device copy (the host copy stays for later passes)."""
        if self._ready.pop(key, None) is not None:
            self.note("release", key)

    def pop(self, key: Key) -> None:
        """Forget a chunk entirely."""
        self._ready.pop(key, None)
        self._held.pop(key, None)

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
        """Order every queued copy before later work on the compute stream."""
        if self.copies:
            torch.cuda.current_stream(self.device).wait_stream(self._side)

    def export(self, keys: Sequence[Key]) -> list[torch.Tensor]:
        """Flat list of the held tensors of `keys` (for `ctx.save_for_backward`)."""
        self.finish()
        return [t for key in keys for t in self._held[key]]

    def load(self, keys: Sequence[Key], counts: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
        """Inverse of `export`: hold `tensors` (already host copies when offloading) again."""
        it = iter(tensors)
        for key, n in zip(keys, counts):
            self._held[key] = tuple(next(it) for _ in range(n))

    def counts(self, keys: Sequence[Key]) -> list[int]:
        return [len(self._held[key]) for key in keys]
