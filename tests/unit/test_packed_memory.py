"""Packed backward peak memory: no fp32 scratch when one kernel call covers every row
(issue 19, item 4; `ops/backends/packed.py`).

The kernel is a stub with the packed-kernel contract that allocates only its outputs
(`torch.empty_like`), so the tracked peak is the backend's own: the flash-layout copies
of dout/q/k/v/out it hands the kernel (5 tensors of q's size here, H = H_kv) and the
kernel's three gradients -- 8 q-sized bf16 tensors. fp32 dq/dk/dv accumulators add 6
more (3 x 2 bytes per bf16 byte) and the final cast 3 more: the old code peaked near 17.
MemTracker (torch.distributed._tools.mem_tracker) counts every tensor allocation on CPU.
"""

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from hf_longctx.ops import kernels
from hf_longctx.ops.backends.packed import PackedBackend
from tests.reference import make_runs


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
