"""Per-layer host work done once per micro-batch: the boundary checks and the kernel choice.

Every layer of a micro-batch passes the same boundaries object (the batch metadata's
`cu_seqlens`) and the same per-batch `plan_cache` (what `patch()` keeps): the checks that
walk every document (`layout.check_boundaries`) and the tuple key over all documents run on
the first layer only, and so does the local attention backend's choice (`select.probe_env`,
the environment probe, and `select.refusal`, the capability checks), which every ring step
and FPDT chunk pair of every layer's forward and backward used to repeat; a new batch (a new
boundaries object, a new cache) checks and chooses again. Counted by wrapping the three
functions, for Ulysses, ring and FPDT; removing either cache makes it once per layer or per
kernel call (checked once each). Forward and backward against nothing else: exactness is
test_usp/test_fpdt/test_ring's.
"""

from __future__ import annotations

import torch

from tests.helpers.pool import worker_mesh

LAYOUTS = {"U2": (2, 1, 1), "R2": (1, 2, 1), "FPDT u=2 (U2)": (2, 1, 2)}  # (ulysses, ring, fpdt chunks)


def _calls_per_batch(ulysses: int, ring: int, chunks: int) -> dict[str, list[int]]:
    """Calls of each counted function in each of 2 micro-batches of 4 layers (fwd + bwd)."""
    from hf_longctx import layout
    from hf_longctx.ops.backends import select
    from hf_longctx.ops.fpdt import fpdt_attention
    from hf_longctx.ops.usp import usp_attention

    mesh = worker_mesh(ulysses, ring, chunks)
    counted = {"check_boundaries": layout, "probe_env": select, "refusal": select}
    calls: dict[str, list[int]] = {name: [] for name in counted}
    originals = {name: getattr(module, name) for name, module in counted.items()}

    def wrap(name):
        def counting(*args, **kwargs):
            calls[name][-1] += 1
            return originals[name](*args, **kwargs)
        return counting

    for name, module in counted.items():
        setattr(module, name, wrap(name))
    try:
        for batch in range(2):
            for per_batch in calls.values():
                per_batch.append(0)
            cu = tuple(list((0, 24, 32, 64)))  # a new tuple object per micro-batch, as shard_batch makes
            cache: dict = {}
            for _ in range(4):
                q, k, v = (torch.randn(1, 64 // mesh.sp, h, 8, requires_grad=True) for h in (4, 2, 2))
                fn = fpdt_attention if chunks > 1 else usp_attention
                fn(q, k, v, mesh, cu_seqlens=cu, plan_cache=cache).sum().backward()
        return calls
    finally:
        for name, module in counted.items():
            setattr(module, name, originals[name])


def test_per_layer_host_work_once_per_micro_batch(pools):
    for label, degrees in LAYOUTS.items():
        for rank, calls in enumerate(pools.get(2).run(_calls_per_batch, *degrees)):
            assert calls == {"check_boundaries": [1, 1], "probe_env": [1, 1], "refusal": [1, 1]}, (label, rank, calls)


def test_document_ids_uploaded_once_per_micro_batch():
    """`doc_sums`' document ids go to the device once per micro-batch (DPO's loss calls it 2-5
    times on one shard), as one non-blocking copy and with no host sync: counted with the
    hot-path counter (`benchmarks/_counting.py`), the shard on the "device", on a ring rank
    (zigzag ids) of a mesh without process groups (the local sums, no collective). A pageable
    `.to(device)` per call is one sync per call (checked once)."""
    from benchmarks._counting import Counter
    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.distributed.doc_sums import doc_sums, local_document_ids
    from hf_longctx.distributed.mesh import SPMesh

    mesh = SPMesh(dp=1, ring=2, ulysses=1, fpdt_chunks=1, dp_rank=0, ring_rank=1, ulysses_rank=0)
    lengths = [12, 4, 16]
    ids = torch.arange(sum(lengths))[None] % 7 + 1
    pos = torch.cat([torch.arange(n) for n in lengths])[None]  # [1, S] per-document positions
    counter = Counter()
    counts, sums = [], []
    with counter.tracking():
        for _ in range(2):  # two micro-batches: a new shard (new metadata) uploads again
            shard = shard_batch({"input_ids": ids, "labels": ids.clone(), "position_ids": pos}, mesh)
            counter.mark_device([v for v in shard.values() if isinstance(v, torch.Tensor)])
            values = shard["input_ids"].float()  # [1, S_local] on the device
            counter.reset()
            with counter.counting():
                sums += [doc_sums(values, shard, mesh) for _ in range(3)]
            counts.append(counter.snapshot())
            (cached,) = shard["sp_batch"].device_cache.values()
            assert torch.equal(cached, local_document_ids(shard, mesh))
    for c in counts:
        assert (c["h2d"], c["syncs"]) == (1, 0), c
    for s in sums[1:]:
        assert torch.equal(s, sums[0])
