"""Pinned host buffers reused per size class (`ops/host_pool.py`), on CPU.

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

from hf_longctx.ops.fpdt import fpdt_backward, fpdt_forward, saved_keys
from hf_longctx.ops.fpdt_schedule import FPDTPlan
from hf_longctx.ops.host_pool import HostPool, plain_bytes, size_class
from hf_longctx.ops.offload import ChunkStore
from tests.helpers.stub_streams import FakeStreams


class PooledFakeStreams(FakeStreams):
    """FakeStreams whose host buffers come from a `HostPool` with a counting CPU allocator."""

    def __init__(self):
        super().__init__()
        self.pool = HostPool(alloc=plain_bytes)

    def pinned(self, like):
        self.log.append(("pinned", tuple(like.shape)))
        host, last = self.pool.take(like)
        if last is not None:
            self.log.append(("wait_event", "out", last.name))
        return host

    def note(self, host, event, write):
        self.pool.note(host, event, write)

    def pending(self, host):
        return self.pool.pending(host)

    def recycle(self, host):
        super().recycle(host)
        self.pool.give(host)


def test_size_classes_waste_less_than_a_sixteenth():
    """16 classes per power of two: a class is at most 1/16 above its request (not 2x)."""
    assert [size_class(n) for n in (0, 1, 2, 3, 17, 31, 32, 33)] == [1, 1, 2, 3, 17, 31, 32, 34]
    assert size_class(1024) == 1024 and size_class(1025) == 1088  # 2^10 + 2^6, not 2048
    for n in list(range(1, 5000)) + [3 * 2**20 + 1, 10**9 + 7, 2**33 + 1]:
        c = size_class(n)
        assert n <= c < n * (1 + 1 / 16) + 1, (n, c)
        assert size_class(c) == c  # a class is its own class: buffers of one class are interchangeable
    classes = {size_class(n) for n in range(2**20 + 1, 2**21 + 1)}
    assert len(classes) == 16  # sixteen classes per power of two


def test_take_keeps_dense_strides_and_waits_for_the_last_copy():
    pool = HostPool(alloc=plain_bytes)
    like = torch.randn(1, 6, 4, 8).transpose(1, 2)  # [B, h, S/u, D] view of a token-major chunk
    host, last = pool.take(like)
    assert last is None and pool.allocated_bytes == size_class(like.numel() * 4)
    assert host.shape == like.shape and host.stride() == like.stride() and host.dtype == like.dtype
    host.copy_(like)
    assert torch.equal(host, like)
    pool.note(host, "write-event", write=True)
    pool.note(host, "read-event", write=False)  # the last copy of this buffer (a read back on the IN stream)
    assert pool.pending(host) == "write-event"  # a reader waits for the write only
    pool.give(host)
    pool.give(host)  # a second hand-back is ignored (never two users of one buffer)
    assert pool.free_bytes() == size_class(like.numel() * 4) and pool.lent_bytes() == 0
    a, last_a = pool.take(like)  # the reused buffer: its next writer must wait for the read
    b, last_b = pool.take(like)  # a new one
    assert (last_a, last_b) == ("read-event", None)
    assert pool.allocations == 2 and a.data_ptr() != b.data_ptr()
    pool.give(torch.empty(3))  # not from the pool: ignored
    del b  # a lent tensor that dies without give() brings its buffer back
    assert pool.free_bytes() == size_class(like.numel() * 4)
    pool.clear()
    assert pool.free_bytes() == 0


def _two_layer_step(plan, streams, q, k, v, dout):
    """Forward of layers 0, 1 then backward of 1, 0 (the FPDT loops, world size 1), the
    forward store's host copies handed to a new backward store as `FPDTAttention` does."""
    keys, saved = saved_keys(plan.chunks), []
    outs = []
    for layer in range(2):
        store = ChunkStore("cpu", offload=True, streams=streams)
        outs.append(fpdt_forward(q[layer], k[layer], v[layer], plan, store))
        saved.append((store.counts(keys), store.export(keys)))
    grads = []
    for layer in (1, 0):
        store = ChunkStore("cpu", offload=True, streams=streams)
        store.load(keys, *saved[layer])
        grads.append(fpdt_backward(dout[layer], outs[layer], plan, store, q[layer].shape, k[layer].shape)[:3])
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
    """Two copy directions, one stream each: no compute-stream wait for device -> host copies
    (the end of a layer does not stall on its offload); each read of a host copy (a prefetch
    on the IN stream) waits for exactly the event of the put that wrote it and for nothing
    else -- in particular not for offloads or compute queued before it; a reused pool buffer
    is written (OUT stream) only after the event of its last read."""
    chunks, s, h, d = 4, 32, 2, 4
    kw = dict(scale=1 / math.sqrt(d), causal=True, window=None, softcap=None)
    plan = FPDTPlan([0, 5, s], chunks, group=None, causal=True, window=None, kw=kw)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = ([torch.randn(1, s, h, d, generator=g) for _ in range(2)] for _ in range(4))
    fake = PooledFakeStreams()
    reads: list = []
    orig_prefetch = ChunkStore.prefetch

    def prefetch(self, key):
        if key not in self._ready:  # the event of the put that wrote this chunk, and where the read starts
            reads.append((key, fake.pending(self._held[key][0]).name, len(fake.log)))
        orig_prefetch(self, key)

    ChunkStore.prefetch = prefetch
    try:
        for _ in range(2):  # the second step reuses every buffer
            _two_layer_step(plan, fake, q, k, v, dout)
    finally:
        ChunkStore.prefetch = orig_prefetch
    recorded = {stream: {e[1] for e in fake.log if e[0] == "record" and e[2] == stream} for stream in ("out", "in")}
    assert reads
    for key, event, at in reads:
        assert event in recorded["out"] and fake.log[at] == ("wait_event", "in", event), (key, event)
    in_waits = [e for e in fake.log if e[1] == "in" and e[0] in ("wait_event", "wait_stream")]
    assert len(in_waits) == len(reads)  # a prefetch waits for nothing else (no wait_stream on main or OUT)
    main_waits = {e[2] for e in fake.log if e[:2] == ("wait_event", "main")}
    assert main_waits <= recorded["in"] and not any(e[:2] == ("wait_stream", "main") for e in fake.log)
    reuse_waits = [e[2] for e in fake.log if e[:2] == ("wait_event", "out")]
    assert reuse_waits and set(reuse_waits) <= recorded["in"]  # a reused buffer: after its last read


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
        out = FPDTAttention.apply(q, k, v, plan, offload_on, None, True)
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


def _step(fake, s: int, chunks: int = 2) -> int:
    """One two-layer FPDT step of length `s` on `fake`'s pool, checked against the store that
    keeps references (no buffer reused while its chunk was held); the buffers it allocated.
    Head dim 16: an lse chunk is 1/16 of its q chunk's bytes (real models: 1/32 and less)."""
    d = 16
    kw = dict(scale=1 / math.sqrt(d), causal=True, window=None, softcap=None)
    plan = FPDTPlan([0, 5, s], chunks, group=None, causal=True, window=None, kw=kw)
    g = torch.Generator().manual_seed(s)
    q, k, v, dout = ([torch.randn(1, s, 2, d, generator=g) for _ in range(2)] for _ in range(4))
    ref_outs, ref_grads = _two_layer_step(plan, None, q, k, v, dout)
    before = fake.pool.allocations
    outs, grads = _two_layer_step(plan, fake, q, k, v, dout)
    for a, b in zip(outs + [t for gs in grads for t in gs], ref_outs + [t for gs in ref_grads for t in gs]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    return fake.pool.allocations - before


def _held(pool: HostPool) -> int:
    return pool.free_bytes() + pool.lent_bytes()


def test_pool_bounded_across_steps_of_different_lengths():
    """The pool never holds more than the most it lent at once, and that is the longest step's
    own peak: a longer step's misses release the shorter steps' free buffers first (without
    the release the pool keeps both, checked once), and no request of a shorter step runs in
    a buffer of another kind (at most FIT x its size)."""
    lengths = [16, 32, 24, 48, 16, 32]
    alone = {}
    for s in set(lengths):  # each length's own peak of lent bytes, on a fresh pool
        fresh = PooledFakeStreams()
        _step(fresh, s)
        alone[s] = fresh.pool.high_water
    fake = PooledFakeStreams()
    for n, s in enumerate(lengths):
        _step(fake, s)
        longest = max(lengths[: n + 1])
        assert fake.pool.lent_bytes() == 0
        assert _held(fake.pool) <= fake.pool.high_water == alone[longest], (s, _held(fake.pool), alone)
    assert fake.pool.releases > 0


def test_no_registration_after_the_longest_step():
    """A step no longer than an earlier one runs in its buffers: registrations (allocations)
    only in the first step when it is the longest (exact size classes alone would register
    in every step of a new length, checked once)."""
    fake = PooledFakeStreams()
    assert [_step(fake, s) for s in (48, 16, 32, 24, 48)][1:] == [0, 0, 0, 0]


def test_prepare_registers_a_longer_step_before_it_runs():
    """`prepare(device, tokens)` before a longer micro-batch registers its buffers, scaled from
    those the pool holds, so the step itself registers none; a shorter or equal one costs
    nothing (without `prepare`'s reservation the longer steps register inside, checked once)."""
    fake = PooledFakeStreams()
    assert _step(fake, 16) > 0 and fake.pool.prepare("cpu", 16) == 0  # the first step sizes the pool
    for s in (32, 24, 48, 16, 48):
        fake.pool.prepare("cpu", s)
        assert _step(fake, s) == 0, s
    assert _held(fake.pool) <= fake.pool.high_water
