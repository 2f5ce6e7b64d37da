"""doc_sums (distributed/doc_sums.py): per-document sums over a sharded batch, forward and
backward against a single-process float64 reference, on Ulysses, ring, U×R and FPDT layouts.

The per-token values depend on a shared parameter w through the token id and its position
in its document, so a token mapped to the wrong document or position, a lost padding mask
or a missing/doubled backward reduction changes the sums or w.grad. The objective is
non-linear in the sums (squares), so each shard's gradient depends on the OTHER shards'
tokens: an identity backward would fail. fp32 sums of tens of values: 1e-5 relative.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_longctx.data.sharding import shard_batch
from hf_longctx.distributed.doc_sums import doc_sums
from tests.helpers.pool import worker_mesh

VOCAB = 50


def _batch(packed: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    if packed:
        lengths = [int(n) for n in torch.randint(3, 12, (4,), generator=g)]
        ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=g)
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        labels = ids.clone()
        cu = [0]
        for n in lengths:
            labels[0, cu[-1]] = -100  # a masked first target per document (prompt-like)
            cu.append(cu[-1] + n)
        return {"input_ids": ids, "labels": labels, "position_ids": pos}, cu
    ids = torch.randint(0, VOCAB, (2, 10), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}, None


def _reference(batch, cu, w):
    """float64 [B, D]: sum over valid shifted targets of w[id]·(1 + position in document)."""
    ids, labels = batch["input_ids"], batch["labels"]
    rows = []
    for r in range(ids.shape[0]):
        bounds = cu if cu is not None else [0, ids.shape[1]]
        sums = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            total = w.new_zeros(())
            for t in range(a, b - 1):  # token t predicts t+1 inside the document
                if labels[r, t + 1] != -100:
                    total = total + w[ids[r, t]] * (1 + t - a)
            sums.append(total)
        rows.append(torch.stack(sums))
    return torch.stack(rows)


def _objective(sums):
    return (sums * torch.arange(1, sums.numel() + 1, dtype=sums.dtype).reshape(sums.shape)).square().sum() / 100


def _run(ulysses, ring, chunks, packed):
    mesh = worker_mesh(ulysses, ring, chunks)
    batch, cu = _batch(packed, seed=7 + mesh.dp_rank)
    w0 = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    shard = shard_batch(batch, mesh)
    w = w0.float().clone().requires_grad_()
    values = w[shard["input_ids"]] * (1 + shard["position_ids"])  # [B, S_local]
    values = values.masked_fill(shard["shift_labels"] == -100, float("nan"))  # the mask must drop these
    sums = doc_sums(values, shard, mesh)
    (_objective(sums) / mesh.sp).backward()  # every SP rank computes the objective: 1/sp each
    grad = w.grad.clone()
    if mesh.sp > 1:
        dist.all_reduce(grad, group=mesh.sp_group)  # [V]: shares summed (loss.sum_gradients' rule)
    ref_w = w0.clone().requires_grad_()
    ref = _reference(batch, cu, ref_w)
    _objective(ref).backward()
    torch.testing.assert_close(sums.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double(), ref_w.grad, rtol=1e-4, atol=1e-4 * ref_w.grad.abs().max().item())
    return True


@pytest.mark.parametrize("ulysses,ring,chunks", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2), (4, 1, 2)])
@pytest.mark.parametrize("packed", [True, False])
def test_doc_sums_match_single_process(pools, ulysses, ring, chunks, packed):
    assert all(pools.get(4).run(_run, ulysses, ring, chunks, packed))


def _bad_shape():
    mesh = worker_mesh(2, 1)
    batch, _ = _batch(True, 0)
    shard = shard_batch(batch, mesh)
    try:
        doc_sums(torch.zeros(1, 3), shard, mesh)
    except ValueError as e:
        return str(e)
    return "no error"


def test_bad_shape_raises_before_collective(pools):
    assert all("do not match the shard" in e for e in pools.get(4).run(_bad_shape))
