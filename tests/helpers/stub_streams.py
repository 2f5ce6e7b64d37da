"""A CPU stand-in for `ops.offload.Streams`, for the tests of the offload schedule.

`FakeStreams` has the exact interface of `Streams` (current / side streams, events, pinned
host buffers, copies to the device, keep-alive and recycle) and logs every wait, record and
copy in program order. It checks the ORDER of operations the CUDA path issues, not CUDA's
behaviour. Used by tests/unit/test_offload.py and test_host_pool.py.
"""

from __future__ import annotations

import torch

class FakeStreams:
    """`ops.offload.Streams` on CPU: named streams and events that log every operation in
    program order; copies run synchronously, and a copy back to the "device" is a real copy
    (a new tensor), so host and device copies are distinct as on a GPU. What it checks is the
    ORDER of waits, records and copies the CUDA path issues, not CUDA's behaviour."""

    def __init__(self):
        self.log: list[tuple] = []
        self.events = 0
        self.last: dict[int, object] = {}  # id(host) -> event after the last copy into it

    class _Stream:
        def __init__(self, owner, name):
            self.owner, self.name = owner, name

        def wait_stream(self, other):
            self.owner.log.append(("wait_stream", self.name, other.name))

        def wait_event(self, event):
            self.owner.log.append(("wait_event", self.name, event.name))

    class _Event:
        def __init__(self, owner, name):
            self.owner, self.name = owner, name

        def record(self, stream):
            self.owner.log.append(("record", self.name, stream.name))

        def query(self):
            return True  # copies run synchronously here: done

    def offloads(self, device):
        return True

    def is_host(self, tensor):
        return False

    def current(self, device):
        return self._Stream(self, "main")

    def side(self, device, direction):
        return self._Stream(self, direction)

    def on(self, stream):
        import contextlib

        log = self.log

        @contextlib.contextmanager
        def ctx():
            log.append(("enter", stream.name))
            yield
            log.append(("exit", stream.name))

        return ctx()

    def event(self):
        self.events += 1
        return self._Event(self, f"e{self.events}")

    def pinned(self, like):
        self.log.append(("pinned", tuple(like.shape)))
        return torch.empty(like.shape, dtype=like.dtype)

    def to_device(self, host, device):
        return host.clone()

    def note(self, host, event, write):
        if write:
            self.last[id(host)] = event

    def pending(self, host):
        return self.last.get(id(host))

    def keep_alive(self, tensor, stream):
        self.log.append(("keep_alive", tuple(tensor.shape), stream.name))

    def recycle(self, host):
        self.log.append(("recycle", tuple(host.shape)))
