"""Packed backward peak memory: no fp32 scratch when one kernel call covers every row
(`ops/backends/packed.py`).

The kernel is a stub with the packed-kernel contract that allocates only its outputs
(`torch.empty_like`), so the tracked peak is the backend's own: the flash-layout copies
of dout/q/k/v/out it hands the kernel (5 tensors of q's size here, H = H_kv) and the
kernel's three gradients -- 8 q-sized bf16 tensors. fp32 dq/dk/dv accumulators add 6
more (3 x 2 bytes per bf16 byte) and the final cast 3 more: an implementation that kept them all would peak near 17.
MemTracker (torch.distributed._tools.mem_tracker) counts every tensor allocation on CPU.
"""

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from hf_longctx.ops import kernels
from hf_longctx.ops.backends.packed import PackedBackend
from tests.helpers.reference import make_runs


class _StubKernel:
    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale, causal, left, right, softcap):
        return torch.zeros_like(q), torch.zeros((q.shape[1], q.shape[0]), dtype=torch.float32)

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, scale, causal, left, right, softcap):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def test_one_call_backward_has_no_fp32_scratch():
    b, h, s, d = 1, 4, 512, 64
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, s, d, generator=g).to(torch.bfloat16) for _ in range(4))
    runs = make_runs([0, 200, 512])  # one packed row of two documents: one causal call
    backend = PackedBackend("stub", _StubKernel())
    kw = dict(scale=d**-0.5, causal=True, backend=backend)
    out, lse = kernels.varlen_forward(q, k, v, runs, runs, **kw)
    tracker = MemTracker()
    with tracker:
        dq, dk, dv = kernels.varlen_backward(dout, q, k, v, out, lse, runs, runs, **kw)
    assert dq.dtype == dk.dtype == dv.dtype == torch.bfloat16
    peak = max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    one = q.numel() * q.element_size()
    # 8 q-sized tensors + lse and cu_seqlens; the fp32 scratch would add 6 (and its cast 3).
    assert peak <= 9 * one, f"peak {peak / one:.2f}x q's bytes: fp32 scratch is back"


def _calls(cu, ring, ring_rank, step, causal=True, window=None):
    from hf_longctx.ops.backends.packed import _plan_calls
    from hf_longctx.ops.ring import ring_plan

    plan = ring_plan(cu, ring, ring_rank, causal=causal, window=window)
    k_runs, tiles = plan.steps[step]
    q = torch.zeros(1, 4, sum(r.length for r in plan.q_runs), 16)
    k = torch.zeros(1, 2, sum(r.length for r in k_runs), 16)
    return _plan_calls(tiles, q, k, causal, window), k.shape[2]


def test_ring_steps_take_the_one_call_path_and_gather_no_key_twice():
    """Zigzag ring over packed documents (cu = [0, 20, 32, 56, 64], R = 2): every rank's own
    step is ONE causal call over its stream as it lies (chunk r then chunk 2R-1-r of each
    document is causal in local order), so no row is gathered and the backward returns the
    kernel's gradients as they are (no float32 index_add); the other steps gather each key
    row at most once (the queries that see the same keys share one sequence)."""
    cu = [0, 20, 32, 56, 64]
    for ring in (2, 4):
        for rank in range(ring):
            calls, _ = _calls(cu if ring == 2 else [0, 40, 64, 112, 128], ring, rank, 0)
            assert len(calls) == 1 and calls[0].q_idx is None and calls[0].k_idx is None and calls[0].causal, (ring, rank)
            for step in range(1, ring):
                calls, sk = _calls(cu if ring == 2 else [0, 40, 64, 112, 128], ring, rank, step)
                for c in calls:
                    if c.k_idx is not None:
                        assert len(set(c.k_idx.tolist())) == len(c.k_idx) <= sk, (ring, rank, step)
                    if c.q_idx is not None:
                        assert len(set(c.q_idx.tolist())) == len(c.q_idx), (ring, rank, step)
