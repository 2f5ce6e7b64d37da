"""The offload manager's schedule (FPDT §3.4 double buffering), recorded through `ChunkStore.trace`.

On CPU the store runs the exact schedule of the CUDA path without copies, so what is checked
here is the order of events: a chunk's fetch is issued before the compute on the previous
chunk ends (double buffering: the copy of n+1 can overlap the compute of n), no chunk is
fetched twice in one pass, and fetched buffers are released when the caller moves on. The
FPDT loops themselves are traced at world size 1 (every all-to-all is the identity).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from hf_longctx.ops.fpdt import fpdt_backward, fpdt_forward, saved_keys
from hf_longctx.ops.fpdt_schedule import FPDTPlan
from hf_longctx.ops.offload import ChunkStore
from tests.helpers.stub_streams import FakeStreams


def _index(trace, event):
    return trace.index(event)


def _check_pass(trace: list, groups: list) -> None:
    """Double buffering and single fetch within one `stream` pass over `groups`."""
    for n, group in enumerate(groups):
        for key in group:
            assert trace.count(("fetch", key)) == 1, f"{key} fetched {trace.count(('fetch', key))} times"
            assert _index(trace, ("fetch", key)) < _index(trace, ("begin", group))
            if ("put", key) not in trace:  # a re-put key (dq accumulator) drops its buffer at the put
                assert _index(trace, ("release", key)) > _index(trace, ("end", group))
        if n + 1 < len(groups):
            for key in groups[n + 1]:
                # the next chunk's copy is issued before this chunk's compute ends
                assert _index(trace, ("fetch", key)) < _index(trace, ("end", group)), (key, trace)


def test_stream_double_buffers_and_fetches_once():
    trace: list = []
    store = ChunkStore("cpu", offload=True, trace=trace)
    groups = [[("kv", i)] for i in range(4)]
    for i in range(4):
        store.put(("kv", i), torch.full((2,), float(i)))
    computed = []
    for group, (t,) in store.stream(groups):
        trace.append(("compute", group))
        computed.append(t[0].item())
    assert computed == [0.0, 1.0, 2.0, 3.0]
    _check_pass(trace, [tuple(g) for g in groups])
    for n, group in enumerate(groups):  # compute n happens between its begin and end, after fetch n+1
        c = _index(trace, ("compute", tuple(group)))
        assert _index(trace, ("begin", tuple(group))) < c < _index(trace, ("end", tuple(group)))
        if n + 1 < len(groups):
            assert _index(trace, ("fetch", groups[n + 1][0])) < c


def test_cpu_store_keeps_references_without_copies():
    store = ChunkStore("cpu", offload=True)
    t = torch.randn(3)
    store.put("a", t)
    assert not store.copies
    assert store.get("a")[0] is t  # CPU: same schedule, no copy
    with pytest.raises(KeyError, match="never put"):
        store.prefetch("b")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned host copies on a side stream)")
def test_cuda_store_round_trips_through_pinned_host():
    store = ChunkStore("cuda", offload=True)
    t = torch.randn(64, 32, device="cuda")
    expect = t.clone()
    store.put("a", t)
    del t
    assert store._held["a"][0].is_pinned() and store._held["a"][0].device.type == "cpu"
    (back,) = store.get("a")
    torch.testing.assert_close(back, expect, rtol=0, atol=0)


def _segment(trace: list, mark) -> list:
    """The events of one pass: from its ("pass", mark) note to the next pass note."""
    lo = trace.index(("pass", mark))
    nxt = [n for n in range(lo + 1, len(trace)) if trace[n][0] == "pass"]
    return trace[lo : nxt[0] if nxt else len(trace)]


@pytest.mark.parametrize("chunks", [2, 4])
def test_fpdt_loops_schedule(chunks):
    s, h, d = 8 * chunks, 2, 4
    cu = [0, 5, s]  # two documents, the first ends inside chunk 0 or 1
    kw = dict(scale=1 / math.sqrt(d), causal=True, window=None, softcap=None)
    plan = FPDTPlan(cu, chunks, group=None, causal=True, window=None, kw=kw)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, s, h, d, generator=g) for _ in range(3))

    trace: list = []
    store = ChunkStore("cpu", offload=True, trace=trace)
    out = fpdt_forward(q, k, v, plan, store)
    # Forward: query chunk i streams the stored K/V chunks 0..i-1, each once, double-buffered.
    kv_fetches = [e for e in trace if e[0] == "fetch" and e[1][0] == "kv"]
    assert len(kv_fetches) == sum(len(n) - 1 for n in plan.needs)
    assert plan.needs == [list(range(i + 1)) for i in range(chunks)]
    for i in range(chunks):
        seg = _segment(trace, ("q", i))
        _check_pass(seg, [(("kv", j),) for j in range(i)])
        # q_i is kept for the backward only: its put comes after this step's K/V fetches and attention
        fetches = [n for n, e in enumerate(seg) if e[0] == "fetch"]
        assert seg.index(("put", ("q", i))) > max(fetches, default=0) and ("end", (("kv", i - 1),)) in seg[
            : seg.index(("put", ("q", i)))] if i else ("put", ("q", i)) in seg

    trace.clear()
    dout = torch.randn(1, s, h, d, generator=g)
    fpdt_backward(dout, out, plan, store, q.shape, k.shape)
    for i in range(chunks):  # the dq accumulator is first stored with chunk i's first gradient: no zeros put
        assert ("put", ("dq", i)) not in trace[: trace.index(("pass", ("kv", plan.needs[i][0])))]
    # Backward: every K/V chunk fetched exactly once (K/V outer); per outer chunk j each
    # query group fetched once, the next group before the current one's compute ends.
    for j in range(chunks):
        assert trace.count(("fetch", ("kv", j))) == 1
        seg = _segment(trace, ("kv", j))
        # the dq accumulator of chunk i exists only after the first K/V chunk it needs (no zeros round-trip)
        groups = [(("q", i), ("do", i), ("lse", i)) + ((("dq", i),) if j != plan.needs[i][0] else ()) for i in plan.users[j]]
        assert plan.users[j] == list(range(j, chunks))
        _check_pass(seg, groups)
        if j + 1 < chunks:  # the next outer K/V chunk is requested before this inner loop starts
            assert seg.index(("fetch", ("kv", j + 1))) < seg.index(("begin", groups[0]))


@pytest.mark.parametrize("causal", [True, False])
def test_fpdt_forward_without_save_keeps_nothing_for_a_backward(causal):
    """A forward whose saved tensors are discarded (a checkpoint's first run): no q or lse is
    put, only the K/V chunks a later step reads (non-causal: q chunks too), all popped at the
    end; what remains are memory-free placeholders with the shapes a saving forward holds, and
    the output is the same."""
    chunks, s, h, d = 4, 32, 2, 4
    kw = dict(scale=1 / math.sqrt(d), causal=causal, window=None, softcap=None)
    plan = FPDTPlan([0, 5, s], chunks, group=None, causal=causal, window=None, kw=kw)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, s, h, d, generator=g) for _ in range(3))
    keys = saved_keys(chunks)
    saving, discarding = ChunkStore("cpu", offload=True), ChunkStore("cpu", offload=True, trace=[])
    ref = fpdt_forward(q, k, v, plan, saving)
    out = fpdt_forward(q, k, v, plan, discarding, save=False)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    puts = {e[1] for e in discarding.trace if e[0] == "put"}
    later = range(chunks - 1)  # the last step's chunks are live: nothing later reads them back
    assert puts == {("kv", j) for j in later} | (set() if causal else {("q", i) for i in later})
    assert {e[1] for e in discarding.trace if e[0] == "placeholder"} >= {("lse", i) for i in range(chunks)}
    for a, b in zip(discarding.export(keys), saving.export(keys)):
        assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device) and a.untyped_storage().nbytes() <= 4


# ---- the stream/event logic, on CPU through FakeStreams (tests/helpers/stub_streams.py) -----


def test_store_stream_protocol_with_fake_streams():
    fake = FakeStreams()
    store = ChunkStore("cpu", offload=True, streams=fake)
    assert store.copies
    t = torch.randn(3, 2)
    store.put("a", t)
    # put: the OUT stream waits for the producer, copies inside the OUT stream, keeps t alive
    # for it, and records the event that readers of the host copy will wait for
    assert fake.log == [("wait_stream", "out", "main"), ("enter", "out"), ("pinned", (3, 2)),
                        ("keep_alive", (3, 2), "out"), ("record", "e1", "out"), ("exit", "out")]
    assert store._held["a"][0] is not t and torch.equal(store._held["a"][0], t)
    fake.log.clear()
    saved = store.export(["a"])
    # the forward -> backward hand-off: no wait at all (the compute stream never reads the host copy)
    assert fake.log == [] and saved[0] is store._held["a"][0]
    back_store = ChunkStore("cpu", offload=True, streams=fake)
    back_store.load(["a"], [1], saved)
    (back,) = back_store.get("a")
    # the read of the host copy (on the IN stream) waits for the copy that wrote it -- the event
    # travels with the host tensor -- and for nothing else; main waits for the read
    assert fake.log == [("wait_event", "in", "e1"), ("enter", "in"), ("record", "e2", "in"), ("exit", "in"),
                        ("keep_alive", (3, 2), "main"), ("wait_event", "main", "e2")]
    assert torch.equal(back, t) and back is not saved[0]


def test_offloaded_checkpoint_stream_protocol_and_gradients():
    from hf_longctx.integrations.checkpointing import offloaded_checkpoint

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    x = torch.randn(5, 4, requires_grad=True)
    ref_out = layer(x * 2)
    ref = torch.autograd.grad(ref_out.square().sum(), [x, *layer.parameters()])

    fake = FakeStreams()
    h = x * 2
    out = offloaded_checkpoint(layer, h, streams=fake)
    # forward: one detached copy on the OUT stream, issued BEFORE the layer runs, and an event after it
    assert fake.log == [("wait_stream", "out", "main"), ("enter", "out"), ("pinned", (5, 4)),
                        ("keep_alive", (5, 4), "out"), ("record", "e1", "out"), ("exit", "out")]
    fake.log.clear()
    grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
    # backward: the read back (IN stream) waits for the copy's event, main waits for the read,
    # and the host buffer goes back to the pool right after
    assert fake.log == [("wait_event", "in", "e1"), ("enter", "in"), ("record", "e2", "in"), ("exit", "in"),
                        ("keep_alive", (5, 4), "main"), ("wait_event", "main", "e2"), ("recycle", (5, 4))]
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (side-stream copies to pinned host memory)")
def test_cuda_offloaded_checkpoint_matches_plain_backward():
    from hf_longctx.integrations.checkpointing import offloaded_checkpoint

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()
    x = torch.randn(512, 64, device="cuda", requires_grad=True)
    ref = torch.autograd.grad(layer(x * 2).square().sum(), [x, *layer.parameters()])
    out = offloaded_checkpoint(layer, x * 2)
    grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


def test_every_store_shares_one_streams_object():
    """One side stream per device for every offload: stores built without `streams` share
    the process's `default_streams()` (whose `side(device)` is created once per device);
    `release_pinned` is callable on any machine."""
    from hf_longctx.ops.offload import ChunkStore, default_streams, release_pinned

    a, b = ChunkStore("cpu", offload=True), ChunkStore("cpu", offload=True)
    assert a._streams is b._streams is default_streams()
    release_pinned()


def test_pinned_host_copy_keeps_the_strides_of_a_head_major_view():
    """The torch contract `CudaStreams.pinned` relies on (pin_memory aside, CUDA-only):
    empty_like(preserve_format) of FPDT's [B, h, S/u, D] view of a token-major chunk has the
    view's strides, so copying into it and back needs no contiguous device copy."""
    x = torch.randn(1, 6, 4, 8).transpose(1, 2)  # [B, h, S/u, D] view of [B, S/u, h, D]
    host = torch.empty_like(x, device="cpu")
    assert host.stride() == x.stride() and not host.is_contiguous()
    back = host.copy_(x).to("cpu", non_blocking=True)
    assert back.stride() == x.stride() and torch.equal(back, x)


def test_keep_attention_region_stream_protocol_and_gradients():
    """checkpoint="attention" on the fake streams: in the forward every tensor the attention
    saves (and its output) goes to pinned host memory on the side stream; the recompute
    starts by prefetching all of them on the side stream, replays the attention (it runs
    once), and the compute stream waits for a prefetch only where its tensor is read.
    Gradients equal a plain backward up to the order of one fp32 sum."""
    from hf_longctx.integrations.checkpoint_attention import AttentionKeeper
    from hf_longctx.integrations.checkpointing import offloaded_checkpoint

    torch.manual_seed(0)
    proj, back = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    calls = []

    def attention(q):  # a token mixer whose autograd nodes save tensors: softmax(q q^T) q
        calls.append(1)
        return torch.softmax(q @ q.t(), dim=-1) @ q  # [T, 4]

    def make_layer(keeper):
        def layer(h):
            q = proj(h)
            if keeper is not None and keeper.replaying():
                a = keeper.replay(q, q, q)
            else:
                with keeper.keeping() if keeper is not None else contextlib.nullcontext():
                    a = attention(q)
                if keeper is not None:
                    keeper.keep(a)
            return back(torch.tanh(a)) + h
        return layer

    x = torch.randn(5, 4, requires_grad=True)
    params = [x, *proj.parameters(), *back.parameters()]
    ref = torch.autograd.grad(make_layer(None)(x * 2).square().sum(), params)
    fake = FakeStreams()
    keeper = AttentionKeeper(fake)
    out = offloaded_checkpoint(make_layer(keeper), x * 2, streams=fake, keeper=keeper)
    forward_log, kept = list(fake.log), fake.log.count(("enter", "out")) - 1  # minus the layer input's copy
    # distinct saved tensors of matmul/softmax/matmul + the output (a tensor saved twice is copied once)
    assert len(calls) == 2 and kept >= 3, (calls, forward_log)
    fake.log.clear()
    grads = torch.autograd.grad(out.square().sum(), params)
    assert len(calls) == 2 and keeper.replayed == 1  # the recompute replayed the attention: it ran once
    backward_log = fake.log
    assert not any(e[0] == "pinned" for e in backward_log)  # nothing new is pinned in the backward
    in_records = [e[1] for e in backward_log if e[0] == "record" and e[2] == "in"]
    input_ready, kept_ready = in_records[0], set(in_records[1:])  # the layer input's read back, then the region's
    assert len(kept_ready) == kept  # every kept tensor prefetched once, at the start of the recompute
    reads = [e[2] for e in backward_log if e[:2] == ("wait_event", "main") and e[2] != input_ready]
    assert set(reads) == kept_ready  # each read waits for its own copy, and only for it
    last_prefetch = max(i for i, e in enumerate(backward_log) if e == ("enter", "in"))
    assert last_prefetch < backward_log.index(("wait_event", "main", reads[0]))  # prefetches issued before any read
    assert sum(e[0] == "recycle" for e in backward_log) == kept + 1  # every host copy back to the pool once read
    for g, r in zip(grads, ref):  # x's gradient sums its two paths in another order: one fp32 rounding (~1e-7)
        torch.testing.assert_close(g, r, rtol=1e-6, atol=0)


def test_checkpoint_inputs_of_the_next_layer_are_prefetched():
    """Two checkpointed layers on one LayerChain (fake streams): the backward recomputes layer
    1 first, and its recompute starts the IN-stream copy of layer 0's input; layer 0's
    recompute then waits for that prefetch (not for a copy issued on the compute stream).
    Layer 1's own input has no prefetch (nothing runs before the first recompute). Gradients
    equal a plain backward."""
    from hf_longctx.integrations.checkpointing import LayerChain, offloaded_checkpoint

    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()) for _ in range(2)]
    x = torch.randn(3, 4, requires_grad=True)
    params = [x, *layers[0].parameters(), *layers[1].parameters()]
    ref = torch.autograd.grad(layers[1](layers[0](x * 2)).square().sum(), params)
    fake, chain = FakeStreams(), LayerChain()
    h = offloaded_checkpoint(layers[0], x * 2, streams=fake, chain=chain, first=True)  # its copy: event e1
    out = offloaded_checkpoint(layers[1], h, streams=fake, chain=chain)  # e2
    assert chain.last is not None
    fake.log.clear()
    grads = torch.autograd.grad(out.square().sum(), params)
    log = fake.log
    # layer 1's recompute: reads its own input back (IN waits e2, record e3; main waits e3), then
    # prefetches layer 0's (IN waits e1, copy, record e4)
    assert log[:10] == [("wait_event", "in", "e2"), ("enter", "in"), ("record", "e3", "in"), ("exit", "in"),
                        ("keep_alive", (3, 4), "main"), ("wait_event", "main", "e3"), ("recycle", (3, 4)),
                        ("wait_event", "in", "e1"), ("enter", "in"), ("record", "e4", "in")], log
    # layer 0 reads the prefetch: no second copy of its input
    assert ("wait_event", "main", "e4") in log and log.count(("enter", "in")) == 2, log
    assert chain.last is None  # nothing of the step stays referenced after its backward
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=0)


def test_empty_host_cache_uses_what_the_installed_torch_has(monkeypatch):
    """torch 2.11 has no `torch.accelerator.empty_host_cache` (AttributeError on an H100 with
    torch 2.11+cu130); the probe falls back to the CUDA allocator's `torch._C._host_emptyCache`,
    and prefers the accelerator API where it exists."""
    import types

    from hf_longctx import _compat

    calls = []
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("cuda"), raising=False)
    monkeypatch.setattr(torch, "accelerator", types.SimpleNamespace(is_available=lambda: True))  # 2.11: no empty_host_cache
    _compat.empty_host_cache()
    assert calls == ["cuda"]
    monkeypatch.setattr(torch, "accelerator", types.SimpleNamespace(is_available=lambda: True,
                                                                     empty_host_cache=lambda: calls.append("accel")))
    _compat.empty_host_cache()
    assert calls == ["cuda", "accel"]
    monkeypatch.setattr(torch, "accelerator", types.SimpleNamespace(is_available=lambda: False,
                                                                     empty_host_cache=lambda: calls.append("x")))
    _compat.empty_host_cache()
    assert calls == ["cuda", "accel"]
