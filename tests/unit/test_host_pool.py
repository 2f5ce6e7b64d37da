"""Pinned host buffers reused per size class (`ops/host_pool.py`, issue 19 item 3), on CPU.

The pool is driven through `ChunkStore` with the fake streams of test_offload.py and a
plain (unpinned) allocator that counts: the FPDT loops of two layers over two training
steps, forward stores exported to backward stores as `FPDTAttention` does. What is checked:
the second step allocates no new buffer, and reusing buffers never corrupts a chunk that is
still held (results equal to the store that keeps references).
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_longctx.ops.fpdt import FPDTPlan, _saved_keys, fpdt_backward, fpdt_forward
from hf_longctx.ops.host_pool import HostPool, size_class
from hf_longctx.ops.offload import ChunkStore
from tests.unit.test_offload import FakeStreams


class PooledFakeStreams(FakeStreams):
    """FakeStreams whose host buffers come from a `HostPool` with a counting CPU allocator."""

    def __init__(self):
        super().__init__()
        self.pool = HostPool(alloc=lambda n: torch.empty(n, dtype=torch.uint8))

    def pinned(self, like):
        self.log.append(("pinned", tuple(like.shape)))
        return self.pool.take(like)

    def recycle(self, host):
        super().recycle(host)
        self.pool.give(host)


def test_size_class_and_take_keeps_dense_strides():
    assert [size_class(n) for n in (0, 1, 2, 3, 4, 5, 1000, 1024, 1025)] == [1, 1, 2, 4, 4, 8, 1024, 1024, 2048]
    pool = HostPool(alloc=lambda n: torch.empty(n, dtype=torch.uint8))
    like = torch.randn(1, 6, 4, 8).transpose(1, 2)  # [B, h, S/u, D] view of a token-major chunk
    host = pool.take(like)
    assert host.shape == like.shape and host.stride() == like.stride() and host.dtype == like.dtype
    host.copy_(like)
    assert torch.equal(host, like)
    pool.give(host)
    pool.give(host)  # a second hand-back is ignored (never two users of one buffer)
    assert pool.free_bytes() == size_class(like.numel() * 4)
    a, b = pool.take(like), pool.take(like)  # one reused, one new
    assert pool.allocations == 2 and a.data_ptr() != b.data_ptr()
    pool.give(torch.empty(3))  # not from the pool: ignored
    pool.clear()
    assert pool.free_bytes() == 0


def _two_layer_step(plan, streams, q, k, v, dout):
    """Forward of layers 0, 1 then backward of 1, 0 (the FPDT loops, world size 1), the
    forward store's host copies handed to a new backward store as `FPDTAttention` does."""
    keys, saved = _saved_keys(plan.chunks), []
    outs = []
    for layer in range(2):
        store = ChunkStore("cpu", offload=True, streams=streams)
        outs.append(fpdt_forward(q[layer], k[layer], v[layer], plan, store))
        saved.append((store.counts(keys), store.export(keys), store.written(keys)))
    grads = []
    for layer in (1, 0):
        store = ChunkStore("cpu", offload=True, streams=streams)
        store.load(keys, *saved[layer])
        grads.append(fpdt_backward(dout[layer], plan, store, q[layer].shape, k[layer].shape)[:3])
    return outs, grads


@pytest.mark.parametrize("chunks", [2, 4])
def test_second_step_allocates_no_pinned_buffer(chunks):
    s, h, d = 8 * chunks, 2, 4
    kw = dict(scale=1 / math.sqrt(d), causal=True, window=None, softcap=None)
    plan = FPDTPlan([0, 5, s], chunks, group=None, causal=True, window=None, kw=kw)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = ([torch.randn(1, s, h, d, generator=g) for _ in range(2)] for _ in range(4))

    ref_outs, ref_grads = _two_layer_step(plan, None, q, k, v, dout)  # no copies: the reference
    fake = PooledFakeStreams()
    counts = []
    for _ in range(2):
        outs, grads = _two_layer_step(plan, fake, q, k, v, dout)
        counts.append(fake.pool.allocations)
        for a, b in zip(outs + [t for gs in grads for t in gs], ref_outs + [t for gs in ref_grads for t in gs]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # no buffer reused while its chunk was held
    assert counts[0] > 0 and counts[1] == counts[0], counts  # step 2: every buffer from the pool
    assert sum(e[0] == "recycle" for e in fake.log) > 0


def test_fpdt_offload_waits_only_where_a_host_copy_is_read():
    """Issue 19 item 3: no compute-stream wait for device -> host copies at the end of a layer
    (the old `finish()` in `export`); each read of a host copy (a prefetch on the side stream)
    waits for exactly the event of the put that wrote it, and no other event."""
    chunks, s, h, d = 4, 32, 2, 4
    kw = dict(scale=1 / math.sqrt(d), causal=True, window=None, softcap=None)
    plan = FPDTPlan([0, 5, s], chunks, group=None, causal=True, window=None, kw=kw)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = ([torch.randn(1, s, h, d, generator=g) for _ in range(2)] for _ in range(4))
    fake = PooledFakeStreams()
    trace: list = []
    orig_put, orig_prefetch = ChunkStore.put, ChunkStore.prefetch

    def put(self, key, *tensors):  # tag each put with the event it records
        orig_put(self, key, *tensors)
        trace.append(("put", key, self._written[key].name))

    def prefetch(self, key):
        if key not in self._ready:
            trace.append(("read", key, self._written[key].name, len(fake.log)))
        orig_prefetch(self, key)

    ChunkStore.put, ChunkStore.prefetch = put, prefetch
    try:
        _two_layer_step(plan, fake, q, k, v, dout)
    finally:
        ChunkStore.put, ChunkStore.prefetch = orig_put, orig_prefetch
    assert ("wait_stream", "main", "side") not in fake.log  # the compute stream never waits for an offload
    reads = [e for e in trace if e[0] == "read"]
    assert reads
    for _, key, event, at in reads:
        # the read's own waits: the side stream after main (ordering), then the put's event
        assert fake.log[at : at + 2] == [("wait_stream", "side", "main"), ("wait_event", "side", event)], (key, event)
    side_waits = [e for e in fake.log if e[:2] == ("wait_event", "side")]
    assert len(side_waits) == len(reads)  # no wait anywhere else
    main_waits = {e[2] for e in fake.log if e[:2] == ("wait_event", "main")}
    put_events = {e[2] for e in trace if e[0] == "put"}
    assert not main_waits & put_events  # the compute stream waits only for copies back to the device


def test_fpdt_attention_with_pooled_offload_matches_and_refuses_a_second_backward(monkeypatch):
    """`FPDTAttention` end to end on the pooled fake streams (the stores it builds use
    `default_streams()`): gradients equal the no-offload ones, the second step allocates no
    buffer, and a second backward through the same graph (its buffers recycled) raises."""
    from hf_longctx.ops import offload
    from hf_longctx.ops.fpdt import FPDTAttention

    chunks, s, h, d = 2, 16, 2, 4
    kw = dict(scale=1 / math.sqrt(d), causal=True, window=None, softcap=None)
    plan = FPDTPlan([0, 5, s], chunks, group=None, causal=True, window=None, kw=kw)
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(1, s, h, d, generator=g) for _ in range(3)]

    def grads(offload_on: bool, retain: bool = False):
        q, k, v = (t.clone().requires_grad_() for t in base)
        out = FPDTAttention.apply(q, k, v, plan, offload_on, None)
        out.square().sum().backward(retain_graph=retain)
        return out, [t.grad for t in (q, k, v)]

    ref_out, ref = grads(False)
    fake = PooledFakeStreams()
    monkeypatch.setattr(offload, "default_streams", lambda: fake)
    allocations = []
    for _ in range(2):
        out, got = grads(True)
        allocations.append(fake.pool.allocations)
        torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert allocations[1] == allocations[0] > 0
    out, _ = grads(True, retain=True)
    with pytest.raises(RuntimeError, match="offload=False"):
        out.square().sum().backward()
