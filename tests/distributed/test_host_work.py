"""Per-layer host work done once per micro-batch: the boundary checks of USP and FPDT.

Every layer of a micro-batch passes the same boundaries object (the batch metadata's
`cu_seqlens`) and the same per-batch `plan_cache` (what `patch()` keeps): the checks that
walk every document (`layout.check_boundaries`) and the tuple key over all documents run on
the first layer only; a new batch (a new boundaries object) checks again. Counted by
wrapping `hf_longctx.layout.check_boundaries`; removing the cache makes it once per layer
(checked once). Forward and backward against nothing else: exactness is test_usp/test_fpdt's.
"""

from __future__ import annotations

import torch

from tests.helpers.pool import worker_mesh


def _checks_per_batch(fpdt: bool) -> list[int]:
    from hf_longctx import layout
    from hf_longctx.ops.fpdt import fpdt_attention
    from hf_longctx.ops.usp import usp_attention

    mesh = worker_mesh(2, 1, 2 if fpdt else 1)
    calls = []
    original = layout.check_boundaries

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    layout.check_boundaries = counted
    try:
        counts = []
        for batch in range(2):
            cu = (0, 24, 32, 64)  # a new tuple object per micro-batch, as shard_batch makes
            cu = tuple(list(cu))
            cache: dict = {}
            before = len(calls)
            for layer in range(4):
                q, k, v = (torch.randn(1, 32, h, 8, requires_grad=True) for h in (4, 2, 2))
                fn = fpdt_attention if fpdt else usp_attention
                fn(q, k, v, mesh, cu_seqlens=cu, plan_cache=cache).sum().backward()
            counts.append(len(calls) - before)
        return counts
    finally:
        layout.check_boundaries = original


def test_boundaries_checked_once_per_micro_batch(pools):
    for fpdt in (False, True):
        for rank, counts in enumerate(pools.get(2).run(_checks_per_batch, fpdt)):
            assert counts == [1, 1], (fpdt, rank, counts)
