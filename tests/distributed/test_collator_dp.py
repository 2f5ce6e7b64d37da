"""LongContextCollator end to end on 4 gloo ranks: 2 DP groups × SP 2 (Ulysses 2, or ring 2).

One training step per case: every rank gets the same global list of documents, runs all of
ITS micro-batches through the patched tiny Llama (forward + backward, gradients
accumulating), then `sum_gradients`. The reference is the unpatched model in one process,
each document run on its own: mean token loss over the whole global batch (labels shifted
per document, -100 ignored), backward. The plan is cost-balanced, so ranks and
micro-batches hold unequal token counts; only the global `num_items_in_batch` makes the
summed gradients equal the reference. A second step has a single document, so one DP group
trains on a padding-only micro-batch and must still join every collective.

Tolerances (relative, max|a-b| / max|b|, as in test_models.py): gradients 1e-4 -- fp32, a
parameter gradient sums ~100 token contributions whose order differs between ranks,
micro-batches, the ring merge and one dense softmax, giving a few 1e-6; a lost target, a
wrong count or an averaged reduction is off by 1e-2 or more. Loss 1e-5 -- fp32 logits of a
2-layer model carry ~1e-7 relative rounding, and the logged loss only re-orders the sum.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.pool import worker_mesh

LOSS_TOL = 1e-5
GRAD_TOL = 1e-4
MAX_TOKENS = 32  # forces several micro-batches per rank: ~104 padded tokens over 2 DP groups
VOCAB = 128
STEPS = {"six_documents": [13, 29, 7, 21, 5, 17], "empty_slot": [9]}


def make_features(lengths: list[int], seed: int = 0) -> list[dict]:
    """Documents of odd, uneven lengths; every other one has an SFT-style masked prompt."""
    g = torch.Generator().manual_seed(seed)
    feats = []
    for d, n in enumerate(lengths):
        ids = torch.randint(1, VOCAB, (n,), generator=g)
        labels = ids.clone()
        if d % 2:
            labels[: n // 3] = -100
        feats.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return feats


def load(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()


def reference(path: str, feats: list[dict]):
    """Mean loss over every valid target of the global batch, each document on its own."""
    model = load(path)
    count = 0
    losses = []
    for f in feats:
        ids = torch.tensor([f["input_ids"]])
        targets = torch.tensor(f["labels"][1:])  # token t predicts label t+1 of its document
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1]  # [L-1, V]
        losses.append(torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum"))
        count += int((targets != -100).sum())
    loss = torch.stack(losses).sum() / count
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, count


def _collator_step(ulysses: int, ring: int, path: str, steps: dict) -> dict:
    from hf_longctx.data.collator import LongContextCollator
    from hf_longctx.integrations.model_patch import patch
    from hf_longctx.distributed.loss import global_loss, sum_gradients

    mesh = worker_mesh(ulysses, ring)
    model = patch(load(path), mesh)
    collator = LongContextCollator(mesh, MAX_TOKENS)
    out = {}
    for name, lengths in steps.items():
        model.zero_grad(set_to_none=True)
        local = torch.zeros(())
        micro_batches = collator(make_features(lengths))
        for mb in micro_batches:
            loss = model(**mb).loss
            loss.backward()  # gradients accumulate; each loss is already a share of the global mean
            local += loss.detach()
        sum_gradients(model.parameters(), mesh)
        out[name] = {
            "loss": global_loss(local, mesh),
            "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None},
            "num_items": collator.last_num_items,
            "tokens": [int(mb["input_ids"].shape[1]) for mb in micro_batches],  # this rank's S_local per micro-batch
            "empty": [not any(pieces) for pieces in collator.last_plan[mesh.dp_rank]],
        }
    return out


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    path = str(tmp_path_factory.mktemp("collator_llama"))
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2)], ids=["dp2xulysses2", "dp2xring2"])
def test_collator_step_matches_global_mean_loss(pools, llama_path, ulysses, ring):
    results = pools.get(4).run(_collator_step, ulysses, ring, llama_path, STEPS, timeout=300)
    for name, lengths in STEPS.items():
        ref_loss, ref_grads, count = reference(llama_path, make_features(lengths))
        per_rank = [r[name] for r in results]
        assert all(r["num_items"] == count for r in per_rank), f"{name}: {[r['num_items'] for r in per_rank]} != {count}"
        for rank, r in enumerate(per_rank):
            assert set(r["grads"]) == set(ref_grads), f"{name} rank {rank}: gradient set differs"
            err = max(rel(r["grads"][n], ref_grads[n]) for n in ref_grads)
            assert err <= GRAD_TOL, f"{name} rank {rank}: grad rel err {err:.2e}"
            assert rel(r["loss"], ref_loss) <= LOSS_TOL, f"{name} rank {rank}: loss {r['loss'].item()} vs {ref_loss.item()}"
        if name == "six_documents":
            # the case is only meaningful if the plan really is uneven and multi-micro-batch
            assert len(per_rank[0]["tokens"]) >= 2
            assert len({t for r in per_rank for t in r["tokens"]}) > 1, "every micro-batch has the same size"
        else:
            assert any(any(r["empty"]) for r in per_rank), "no rank got an empty micro-batch slot"
