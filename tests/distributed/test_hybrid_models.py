"""Hybrid models (linear mixers + attention) under SP vs the UNPATCHED model run one document
at a time: loss and every gradient.

The reference is per document because transformers' own torch paths of the linear mixers
(convolutions, Gated DeltaNet) ignore document boundaries when documents are packed by
position_ids: they would leak state across documents, and comparing with that would be
comparing with a wrong answer. Each reference document gets `num_items_in_batch` = the
packed batch's valid-target count, so the per-document losses add up to the packed loss.

The GDN and Mamba-2 families run the head all-to-all (`mixers="heads"`). Configs are tiny
and built to force every branch of the schemes: GDN key heads 2 / value
heads 4 (split by key head on 2 ranks, q/k replicated on 4), an odd head count (Qwen3-Next
1 key / 3 value heads: uneven value split on 2 ranks), OLMo-hybrid 3 key / 6 value heads on
4 ranks (a rank's value heads span two key heads), LFM2 short convolutions of kernel 3 and 4,
Mamba-2 with n_groups 1 (Granite-4, Nemotron-H) and 2 (Bamba, Zamba2) on 4 ranks (B/C
replicated), Falcon-H1 with 3 heads (uneven), scan chunks of 4 (several per document).
The batch holds unequal documents, one shorter than every conv kernel, plus padding on
every mesh (zigzag chunks of 1-2 tokens: the halo comes from several ranks).

Tolerances (relative, max|a-b| / max|b|), fp32: loss 1e-5, gradients 1e-4, as in
`test_models.py` (summation order only); a leak across documents or a lost halo gives 1e-2+.
"""

from __future__ import annotations

import pytest

from tests.helpers.families import compare
from tests.helpers.pool import worker_mesh
from tests.helpers.hybrid_models import DOCS, _rows, build, heads_scheme, packed_batch, per_document_reference, sp_run

LOSS_TOL = 1e-5
GRAD_TOL = 1e-4


def _families(ulysses: int, ring: int, families: list, docs=DOCS, fpdt_chunks: int = 1) -> dict:
    from hf_longctx.integrations.model_patch import patch

    mesh = worker_mesh(ulysses, ring, fpdt_chunks=fpdt_chunks)
    batch = packed_batch(docs)
    out = {}
    for family in families:
        ref_loss, ref_grads = per_document_reference(build(family), batch)
        loss, grads = sp_run(patch(build(family), mesh, mixers=heads_scheme(family)), batch, mesh)
        out[family] = compare(ref_loss, ref_grads, loss, grads)
    return out


def _assert_exact(results, ulysses, ring):
    for rank, per_family in enumerate(results):
        for family, errs in per_family.items():
            where = f"{family} mesh U×R = {ulysses}×{ring} rank {rank}: {errs}"
            assert "missing_grads" not in errs, where
            assert errs["loss"] <= LOSS_TOL and errs["grad"] <= GRAD_TOL, where


# Full cross product of meshes for the GDN family; fewer for the others (CI budget).
CASES = [
    (2, 2, 1, ["qwen3_5_text", "lfm2", "qwen3_next", "falcon_h1"]),
    (2, 1, 2, ["qwen3_5_text", "lfm2_k4", "qwen3_next", "falcon_h1", "zamba2", "recurrent_gemma"]),
    (4, 2, 2, ["qwen3_5_text", "lfm2", "olmo_hybrid", "bamba", "nemotron_h", "recurrent_gemma"]),
    (4, 4, 1, ["qwen3_5_text", "olmo_hybrid", "granitemoehybrid", "lfm2_moe"]),
    (4, 1, 4, ["qwen3_5_text", "lfm2_k4", "bamba", "qwen3_5_moe_text", "zamba2", "recurrent_gemma"]),
]


@pytest.mark.parametrize("world,ulysses,ring,families", CASES, ids=[f"w{w}-u{u}r{r}" for w, u, r, _ in CASES])
def test_hybrid_matches_per_document_reference(pools, world, ulysses, ring, families):
    results = pools.get(world).run(_families, ulysses, ring, families, timeout=300)
    _assert_exact(results, ulysses, ring)


def test_rglru_exchange_backward_runs_on_every_rank(pools):
    """U=2 on documents [13, 8, 9]: rank 0's runs both start documents, so it uses none of the
    RG-LRU summaries it receives while rank 1 does. The exchange's backward is a collective:
    autograd pruned it on rank 0 and the ranks mismatched (gloo abort / hang) before the fix."""
    _assert_exact(pools.get(2).run(_families, 2, 1, ["recurrent_gemma"], [13, 8, 9], timeout=120), 2, 1)


def _without_wrappers(family: str) -> dict:
    """The same patched model with the mixer wrappers taken off: its mixers then run on each
    shard as if it were the whole sequence. The test must see the difference."""
    from hf_longctx.integrations.model_patch import patch
    from hf_longctx.integrations.patch_state import STATE_ATTR

    mesh = worker_mesh(2, 2)
    batch = packed_batch()
    ref_loss, ref_grads = per_document_reference(build(family), batch)
    model = patch(build(family), mesh, mixers=heads_scheme(family))
    state = model.__dict__[STATE_ATTR]
    state.mixers.restore()
    state.mixers = None
    loss, grads = sp_run(model, batch, mesh)
    return compare(ref_loss, ref_grads, loss, grads)


def test_without_wrappers_gradients_are_wrong(pools):
    for family in ("qwen3_5_text", "lfm2", "bamba", "recurrent_gemma"):
        for rank, errs in enumerate(pools.get(4).run(_without_wrappers, family, timeout=300)):
            assert errs["grad"] > 100 * GRAD_TOL, f"{family} rank {rank}: unwrapped mixers look exact {errs}"


def test_hybrid_under_fpdt_chunks(pools):
    """FPDT's rank-ordinal chunk layout: the mixers exchange the whole sequence (they are not
    chunked), so they are exact under it too; only attention runs chunk by chunk."""
    families = ["qwen3_5_text", "lfm2", "bamba"]
    _assert_exact(pools.get(2).run(_families, 2, 1, families, DOCS, 2, timeout=300), 2, 1)


def test_hybrid_rows_of_one_document(pools):
    _assert_exact(pools.get(2).run(_rows, ["qwen3_5_text", "lfm2", "bamba", "recurrent_gemma"], timeout=300), 1, 2)
