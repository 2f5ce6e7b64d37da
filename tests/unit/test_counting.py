"""The hot-path counter (`benchmarks/_counting.py`) sees every kind of host sync, and only those.

Each fault runs on a tensor marked as on the device, inside `counter.counting()`; it must
be counted as a sync with its site named. The allowed operations next to each (a
non-blocking copy, a device index, a host scalar, host-only work) must count none. The
backward faults sit in a custom autograd Function's backward, reached through
`loss.backward()` -- the path a `TorchFunctionMode` alone would hide -- and the host index is
built before the count (cached from a warm-up), the case a provenance rule that only knows
tensors made inside the count misses.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks._counting import Counter
from benchmarks._stubs import StubStreams

FAULTS = {
    "item": (lambda x, idx: x.sum().item(), "aten._local_scalar_dense"),
    "bool": (lambda x, idx: bool(x.sum() > 0), "aten._local_scalar_dense"),
    "nonzero": (lambda x, idx: x.nonzero(), "aten.nonzero"),
    "masked_select": (lambda x, idx: x.masked_select(x > 0), "aten.masked_select"),
    "repeat_interleave without output_size": (lambda x, idx: torch.repeat_interleave((x[0] > 0).long()),
                                              "aten.repeat_interleave"),
    "tolist": (lambda x, idx: x.tolist(), "Tensor.tolist()"),
    ".cpu()": (lambda x, idx: x.cpu(), "blocking device->host .cpu()"),
    ".to('cpu')": (lambda x, idx: x.to("cpu"), "blocking device->host .to()"),
    "device->host copy_": (lambda x, idx: torch.empty(4, 5).copy_(x), "blocking device->host copy_"),
    "pageable upload": (lambda x, idx: torch.arange(3).to(x.device), "blocking host->device .to()"),
    "host->device copy_": (lambda x, idx: x.copy_(torch.zeros(4, 5)), "blocking host->device copy_"),
    "torch.tensor(data, device=)": (lambda x, idx: torch.tensor([1, 2], device=x.device), "torch.tensor(data, device=)"),
    "cached host index": (lambda x, idx: x.index_select(1, idx), "reads a host tensor"),
    "cached host index, advanced indexing": (lambda x, idx: x[:, idx], "reads a host tensor"),
}
ALLOWED = {
    "non-blocking upload": lambda x, idx: torch.arange(3).to(x.device, non_blocking=True),
    "non-blocking copy_ to host": lambda x, idx: torch.empty(4, 5).copy_(x, non_blocking=True),
    "device index": lambda x, idx: x.index_select(1, torch.arange(3, device=x.device)),
    "host scalar": lambda x, idx: x * torch.tensor(2.0),
    "on-device mask": lambda x, idx: x.masked_fill(x > 0, 0.0),
    "host-only work": lambda x, idx: torch.arange(5).cumsum(0).tolist(),
}


def _setup():
    counter = Counter()
    with counter.tracking():
        cached = torch.arange(3)  # built on the host before the count (a warm-up's cache)
        x = torch.randn(4, 5)
        counter.mark_device(x)
    return counter, x, cached


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_kind_of_sync_is_counted(fault):
    counter, x, idx = _setup()
    fn, site = FAULTS[fault]
    with counter.counting():
        fn(x, idx)
    assert counter.counts["syncs"] == 1 and site in counter.sync_sites[0], (counter.counts, counter.sync_sites)


@pytest.mark.parametrize("case", list(ALLOWED))
def test_what_does_not_block_is_not_a_sync(case):
    counter, x, idx = _setup()
    with counter.counting():
        ALLOWED[case](x, idx)
    assert counter.counts["syncs"] == 0, counter.sync_sites


class _ReadsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return a * 2

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors  # unpacked by the engine: a new tensor object on a's storage
        a.tolist()
        g.cpu()
        return g * 2


def test_python_reads_inside_a_custom_backward_are_counted():
    counter = Counter()
    with counter.tracking():
        w = torch.randn(3, requires_grad=True)
        counter.mark_device(w)
    with counter.counting():
        _ReadsInBackward.apply(w * 1.0).sum().backward()
    assert counter.counts["syncs"] == 2 and counter.counts["d2h"] == 1, counter.sync_sites
    assert w.grad is not None and torch.equal(w.grad, torch.full((3,), 2.0))  # the engine really ran


def test_device_copies_stay_device_and_host_copies_stay_host():
    """On CPU `.to(device)` hands back its input; the counter's copy is a tensor of its own."""
    counter, x, idx = _setup()
    with counter.counting():
        up = idx.to(x.device, non_blocking=True)
        down = x.to("cpu", non_blocking=True)
        x.index_select(1, up)  # no sync: the device copy
    assert counter.is_device(up) and not counter.is_device(idx) and not counter.is_device(down)
    assert counter.counts == {"kernels": 1, "collectives": 0, "h2d": 1, "d2h": 1, "syncs": 0}, counter.sync_sites


def test_stub_stream_synchronize_is_a_sync():
    counter = Counter()
    streams = StubStreams(counter)
    with counter.counting():
        event = streams.event()
        event.record(streams.side(torch.device("cpu")))
        streams.current(torch.device("cpu")).wait_event(event)
        assert counter.counts["syncs"] == 0
        event.synchronize()
    assert counter.sync_sites == ["event.synchronize()"]
    host = streams.pinned(torch.zeros(2, 3).t())
    assert host.stride() == (1, 3) and not counter.is_device(host)
