"""The GPU-side pieces the hot-path count runs against on CPU: a counted kernel and stub streams.

Where it sits: next to `benchmarks/_counting.py` (the counter), used by
`benchmarks/hot_path.py`. `CountedKernel` wraps an emulated packed kernel
(`tests/emulated_backends.py`) so that each call counts as one kernel, its internals hidden,
its outputs on the device. `StubStreams` is `ops.offload.Streams` for the CUDA offload branch
on CPU -- it offloads, its pinned buffers are host tensors, streams and events do nothing
except `synchronize()`, which is a sync as on a GPU -- and `stub_offload` hands it to every
offload of the library (FPDT chunk stores, offloaded checkpoint inputs, kept attention).
"""

from __future__ import annotations

import contextlib

import torch

from benchmarks._counting import Counter


class CountedKernel:
    """A packed-kernel adapter whose calls count as one kernel each, internals hidden, outputs on the device."""

    def __init__(self, kernel, counter: Counter):
        self.kernel, self.counter = kernel, counter

    def forward(self, *args, **kwargs):
        with self.counter.opaque():
            out = self.kernel.forward(*args, **kwargs)
        self.counter.mark_device(out)
        return out

    def backward(self, *args, **kwargs):
        with self.counter.opaque():
            out = self.kernel.backward(*args, **kwargs)
        self.counter.mark_device(out)
        return out


class StubStreams:
    """`ops.offload.Streams` for the CUDA offload branch on CPU: it offloads, its pinned
    buffers are host tensors, streams and events do nothing -- except `synchronize()`, which
    is what it is on a GPU: a sync."""

    def __init__(self, counter: Counter):
        from hf_longctx.ops.host_pool import HostPool, plain_bytes

        self.c = counter
        self.pool = HostPool(alloc=plain_bytes)  # the real pool's classes and reuse, unpinned memory

    class _Handle:
        def __init__(self, c: Counter, what: str):
            self.c, self.what = c, what

        def wait_stream(self, other):
            pass

        def wait_event(self, event):
            pass

        def record(self, stream=None):
            pass

        def query(self):
            return True

        def synchronize(self):
            self.c.sync(f"{self.what}.synchronize()")

    def offloads(self, device) -> bool:
        return True

    def current(self, device):
        return self._Handle(self.c, "stream")

    def side(self, device, *args):
        return self._Handle(self.c, "stream")

    def on(self, stream):
        return contextlib.nullcontext()

    def event(self, *args, **kwargs):
        return self._Handle(self.c, "event")

    def is_host(self, tensor: torch.Tensor) -> bool:
        return self.pool.owns(tensor)

    def pinned(self, like: torch.Tensor) -> torch.Tensor:
        return self.pool.take(like)[0]  # like's strides, host memory

    def to_device(self, host: torch.Tensor, device) -> torch.Tensor:
        return host.to(device, non_blocking=True, copy=True)  # as CudaStreams (a distinct tensor: the buffer is reused)

    def note(self, host: torch.Tensor, event, write: bool) -> None:
        self.pool.note(host, event, write)

    def pending(self, host: torch.Tensor):
        return self.pool.pending(host)

    def recycle(self, host: torch.Tensor) -> None:
        self.pool.give(host)

    def keep_alive(self, tensor: torch.Tensor, stream) -> None:
        pass


@contextlib.contextmanager
def stub_offload(counter: Counter):
    """Every offload of the library (FPDT chunk stores, offloaded checkpoint inputs, kept
    attention) takes its CUDA branch with `StubStreams`."""
    from hf_longctx.integrations import checkpointing
    from hf_longctx.ops import offload

    stub = StubStreams(counter)
    saved = offload.default_streams, checkpointing.default_streams
    offload.default_streams = checkpointing.default_streams = lambda: stub
    try:
        yield stub
    finally:
        offload.default_streams, checkpointing.default_streams = saved
