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
        saved.append((store.counts(keys), store.export(keys)))
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
