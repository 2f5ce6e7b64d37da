"""Vision-language models under SP on 4 gloo ranks vs one process: loss and every gradient.

Rows mix text-only documents, several images of different sizes and (Qwen families) a
3-slice video; images straddle shard boundaries on every mesh; the vision work is dealt by
encoder cost, so some ranks encode nothing and some hold no image token. The reference is
the documents ONE AT A TIME through transformers' own path (its own M-RoPE, its own image
merge), fp32 and float64 (`tests/helpers/vlm_cases.compare`: fp32 loss within 1e-5 and every
gradient -- language model, projector, vision tower -- within 1e-4 of the float64 truth,
or within twice the single-process fp32 error where that is larger; bf16 by the project's bf16
rule, `tests/helpers/bf16_rule`: per-token losses and gradient tensors within twice the
single-process bf16 error, the loss by its reduction of the per-token losses). Meshes: U2×R2 (shard_multimodal), dp2×U2 (MultimodalCollator,
two DP ranks with different documents, global normaliser), Ulysses 4 with 2 FPDT chunks;
families Qwen2.5-VL, Qwen3-VL (DeepStack), Gemma 3 (sliding window), LLaVA, and one
Qwen3.5 (Gated DeltaNet hybrid) row; the language model's memory options ride along
(checkpoint="attention" on dp2×U2; memory="max" -- K/V offload, offloaded checkpointing,
chunked MLP and LM head + loss -- with FPDT). A broken route (two received rows swapped) must fail.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.pool import worker_mesh

MAX_TOKENS = 96  # the collator's cap: 2 micro-batches per step on dp2×U2


def _run(ulysses: int, ring: int, chunks: int, families: list, collate: bool, corrupt: bool = False,
         knobs: dict | None = None) -> dict:
    from hf_longctx.data.multimodal.collator import MultimodalCollator
    from hf_longctx.data.multimodal.sharding import SP_VISION_KEY, shard_multimodal
    from hf_longctx.integrations.model_patch import patch
    from hf_longctx.integrations.vision.registry import vision_spec
    from hf_longctx.distributed.loss import global_loss, sum_gradients
    from tests.helpers.vlm_cases import build, compare, mixed_documents, packed_row, references

    mesh = worker_mesh(ulysses, ring, chunks)
    results = {}
    for family in families:
        docs = mixed_documents(family) + (mixed_documents(family, seed=1) if collate else [])
        refs = references(family, docs)
        model = build(family)
        spec = vision_spec(model)
        if collate:
            shards = MultimodalCollator(mesh, MAX_TOKENS, spec)(docs)
        else:
            shards = [shard_multimodal(packed_row(docs), mesh, spec)]
        if corrupt:  # swap two received rows on every rank that holds two
            import dataclasses

            for s in shards:
                vs = s[SP_VISION_KEY]
                order = vs.plan.recv_order.clone()
                if len(order) > 1:
                    order[[0, -1]] = order[[-1, 0]]
                s[SP_VISION_KEY] = dataclasses.replace(vs, plan=dataclasses.replace(vs.plan, recv_order=order))
        patch(model, mesh, **(knobs or {}))
        model.zero_grad(set_to_none=True)
        local = torch.zeros(())
        for shard in shards:
            out = model(**shard)
            out.loss.backward()
            local = local + out.loss.detach()
        sum_gradients(model.parameters(), mesh)
        errs = compare(*refs, global_loss(local, mesh), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        vs = [s[SP_VISION_KEY] for s in shards if SP_VISION_KEY in s]
        errs["loads"] = [v.loads for v in vs]
        errs["local_tokens"] = sum(sum(v.local_counts) for v in vs)
        errs["micro_batches"] = len(shards)
        errs["chunked_loss"] = out.logits is None  # memory presets: the LM head + loss ran chunked
        results[family] = errs
    return results


def _check(results, where: str) -> None:
    for rank, per_family in enumerate(results):
        for family, e in per_family.items():
            msg = f"{family} {where} rank {rank}: {e}"
            assert not e["missing"], msg
            assert e["loss"] <= 1 and e["language"] <= 1 and e["projector"] <= 1 and e["vision"] <= 1, msg
            assert min(e["language_max"], e["projector_max"], e["vision_max"]) > 1e-3, f"a part got no gradient: {msg}"


CASES = [  # (ulysses, ring, fpdt chunks, families, through the collator, patch() memory knobs)
    (2, 2, 1, ["qwen2_5_vl", "qwen3_vl", "gemma3", "llava", "qwen3_5"], False, {}),
    (2, 1, 1, ["qwen2_5_vl", "qwen3_vl", "gemma3"], True, {"checkpoint": "attention"}),  # dp 2 × Ulysses 2
    (4, 1, 2, ["qwen2_5_vl", "qwen3_vl", "gemma3"], False, {"memory": "max"}),  # FPDT + K/V offload, checkpointing, chunks
]


@pytest.mark.parametrize("ulysses,ring,chunks,families,collate,knobs", CASES)
def test_vlm_matches_one_process(pools, ulysses, ring, chunks, families, collate, knobs):
    results = pools.get(4).run(_run, ulysses, ring, chunks, families, collate, False, knobs, timeout=300)
    _check(results, f"U{ulysses}xR{ring} chunks {chunks}{' collator' if collate else ''} {knobs}")
    assert all(r[f]["chunked_loss"] == (knobs.get("memory") == "max") for r in results for f in families)
    for family in families:
        loads = [r[family]["loads"] for r in results]
        assert all(l == loads[0] for l in loads), f"{family}: ranks disagree on the deal {loads}"
        per_rank = [max(mb) for mb in zip(*[ld for ld in loads[0]])] if loads[0] else []
        assert per_rank and max(per_rank) < sum(per_rank), f"{family}: one rank encoded the whole micro-batch {loads[0]}"
    if (ulysses, ring) == (2, 2):  # the deal leaves a rank without work and a shard without image tokens
        gemma = [r["gemma3"] for r in results]
        assert min(min(ld) for ld in gemma[0]["loads"]) == 0.0, gemma[0]["loads"]


def test_a_broken_route_is_caught(pools):
    results = pools.get(4).run(_run, 2, 2, 1, ["qwen2_5_vl"], False, True, timeout=300)
    worst = max(max(r["qwen2_5_vl"]["vision"], r["qwen2_5_vl"]["language"]) for r in results)
    assert worst > 100, f"two swapped embedding rows went unnoticed: {worst}"


# ---- bf16 -----------------------------------------------------------------------------------


def _bf16(ulysses: int, ring: int, family: str) -> dict:
    """Autocast bf16 over fp32 weights (Trainer bf16=True): SP, one process, and float64 truth,
    judged by `tests/helpers/bf16_rule`: the per-token losses and every gradient tensor (small
    ones pooled) by the vector rule, the loss by its reduction of the per-token losses."""
    from hf_longctx.data.multimodal.sharding import shard_multimodal
    from hf_longctx.distributed.gather import gather_sequence
    from hf_longctx.integrations.model_patch import patch
    from hf_longctx.distributed.loss import global_loss, sum_gradients
    from tests.helpers.bf16_rule import criterion, pooled_small, reduction_excess, token_losses
    from tests.helpers.vlm_cases import build, double, mixed_documents, packed_row, reference_tokens, row_targets

    mesh = worker_mesh(ulysses, ring)
    docs = mixed_documents(family)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, g1, tok1 = reference_tokens(build(family), docs)
    _, g64, tok64 = reference_tokens(build(family).double(), double(docs))
    model = patch(build(family), mesh)
    shard = shard_multimodal(packed_row(docs), mesh, model=model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**shard)
    out.loss.backward()
    sum_gradients(model.parameters(), mesh)
    tok = token_losses(gather_sequence(out.logits, shard, mesh), row_targets(docs))
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    rows = [("tokens", tok64, tok1, tok)] + pooled_small([(n, g64[n], g1[n].double(), grads[n].double()) for n in g64])
    results = {name: criterion(t, s, r) for name, t, s, r in rows}
    results["loss"] = reduction_excess(global_loss(out.loss, mesh).item(), tok, tok.numel(), mesh.sp)
    return results


def test_vlm_bf16_within_the_bf16_rule(pools):
    from tests.helpers.bf16_rule import _check

    _check([{"qwen2_5_vl U2xR2": r} for r in pools.get(4).run(_bf16, 2, 2, "qwen2_5_vl", timeout=300)])
