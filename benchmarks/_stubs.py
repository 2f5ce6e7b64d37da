"""The GPU-side pieces the hot-path count runs against on CPU: a counted kernel and stub streams.

Where it sits: next to `benchmarks/_counting.py` (the counter), used by
`benchmarks/hot_path.py`. `CountedKernel` wraps an emulated packed kernel
(`tests/helpers/emulated_backends.py`) so that each call counts as one kernel, its internals hidden,
its outputs on the device, and reaches `Counter.record` with its operands. `StubStreams` is `ops.offload.Streams` for the CUDA offload branch
on CPU -- it offloads, its pinned buffers are host tensors, streams and events do nothing
except `synchronize()`, which is a sync as on a GPU -- and `stub_offload` hands it to every
offload of the library (FPDT chunk stores, offloaded checkpoint inputs, kept attention).
"""

from __future__ import annotations

import contextlib

import torch

from benchmarks._counting import Counter
from benchmarks.census import EmulatedStreams, emulated_offload


class CountedKernel:
    """A packed-kernel adapter whose calls count as one kernel each, internals hidden, outputs on the device."""

    def __init__(self, kernel, counter: Counter):
        self.kernel, self.counter = kernel, counter

    def forward(self, *args, **kwargs):
        return self._call("forward", args, kwargs)

    def backward(self, *args, **kwargs):
        return self._call("backward", args, kwargs)

    def _call(self, direction: str, args: tuple, kwargs: dict):
        active = self.counter.active
        with self.counter.opaque():
            out = getattr(self.kernel, direction)(*args, **kwargs)
        self.counter.mark_device(out)
        if active:  # the op stream keeps the call with its operands (`Counter.record`)
            self.counter.record("attention", direction, args, kwargs, out)
        return out


class StubStreams(EmulatedStreams):
    """`ops.offload.Streams` for the CUDA offload branch on CPU: `census.EmulatedStreams` (the
    real host pool's classes and reuse in plain memory) whose copies back are `.to(device)` calls
    the counter sees, and whose streams and events do nothing -- except `synchronize()`, which
    is what it is on a GPU: a sync."""

    def __init__(self, counter: Counter):
        super().__init__()
        self.c = counter

    class _Handle:
        def __init__(self, c: Counter, what: str):
            self.c, self.what = c, what

        def wait_stream(self, other):
            pass

        def wait_event(self, event):
            pass

        def record(self, stream=None):
            pass

        def synchronize(self):
            self.c.sync(f"{self.what}.synchronize()")

        def query(self):
            return True  # cudaEventQuery: asks, never waits (no sync)

    def current(self, device):
        return self._Handle(self.c, "stream")

    def side(self, device, *args):
        return self._Handle(self.c, "stream")

    def event(self, *args, **kwargs):
        return self._Handle(self.c, "event")

    def to_device(self, host: torch.Tensor, device) -> torch.Tensor:
        return host.to(device, non_blocking=True, copy=True)  # as CudaStreams (a distinct tensor: the buffer is reused)


@contextlib.contextmanager
def stub_offload(counter: Counter):
    """Every offload of the library (FPDT chunk stores, offloaded checkpoint inputs, kept
    attention, row-chunked layers) takes its CUDA branch with `StubStreams`."""
    stub = StubStreams(counter)
    with emulated_offload(stub):
        yield stub
