"""Patched models with attention sinks against their per-document reference (a pool task).

`models_on_mesh(ulysses, ring, paths)` runs, per saved model, the patched model on this
rank's shard of the packed batch of tests/helpers/families.py and returns the loss and
gradient errors against `per_document_reference` (the unpatched model run on each
document alone, normalised by the packed batch's target count: some families build their
masks without position_ids, so their own packed forward would let documents attend to each
other), plus the sink parameters' count, smallest gradient and error. `documents` splits a
packed row where position_ids restart. Used by tests/distributed/test_sinks.py and
test_contiguous.py.
"""

from __future__ import annotations

import torch

from tests.helpers.pool import worker_mesh
from tests.helpers.reference import rel_err


def save_with_visible_sinks(model, path: str) -> str:
    """Set `model`'s sink logits to order 1 (HF initialises them near 0: they must visibly matter,
    a draw seeded by each parameter's name) and `save_pretrained` it to `path`; returns `path`."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) + 1.0)
    model.save_pretrained(path)
    return path


def per_document_reference(model, docs: list[torch.Tensor]):
    """Loss and gradients of the unpatched model run on each document ALONE, normalised by
    the packed batch's target count: what a packed batch means. Not `model(**packed)`:
    GPT-OSS, JetMoE and AFMoE (transformers 5.23) build their masks without position_ids,
    so their unpatched forward on a packed row lets documents attend to each other."""
    model.zero_grad(set_to_none=True)
    n_items = sum(len(d) - 1 for d in docs)  # targets of the packed row: every token but each document's last
    loss = 0.0
    for d in docs:
        out = model(input_ids=d[None], labels=d[None], num_items_in_batch=n_items, use_cache=False)
        out.loss.backward()
        loss += out.loss.detach()
    return loss, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def documents(batch: dict) -> list[torch.Tensor]:
    """The documents of a packed row, split where position_ids restart at 0."""
    ids, pos = batch["input_ids"][0], batch["position_ids"][0]
    starts = (pos == 0).nonzero().flatten().tolist() + [len(ids)]
    return [ids[a:b] for a, b in zip(starts[:-1], starts[1:])]


def models_on_mesh(ulysses: int, ring: int, paths: dict) -> dict:
    """Per family: loss/gradient errors of the patched model on this mesh against the
    per-document reference, plus the sink parameters' (also test_contiguous.py's check)."""
    from hf_longctx.integrations.model_patch import patch
    from tests.helpers.families import compare, load, packed_batch, sp_loss_and_grads

    mesh = worker_mesh(ulysses, ring)
    batch = packed_batch()
    out = {}
    for family, path in paths.items():
        ref_loss, ref_grads = per_document_reference(load(path), documents(batch))
        loss, _, grads = sp_loss_and_grads(patch(load(path), mesh), batch, mesh)
        missing = sorted(set(ref_grads) ^ set(grads))
        if missing:  # e.g. sinks ignored: they get no gradient at all
            out[family] = {"missing_grads": missing}
            continue
        errs = compare(ref_loss, ref_grads, loss, grads)
        sinks = [n for n in ref_grads if n.endswith("sinks")]
        errs["sink_params"] = float(len(sinks))
        errs["min_sink_grad"] = min(grads[n].abs().max().item() for n in sinks) if sinks else 0.0
        errs["sink_grad"] = max(rel_err(grads[n], ref_grads[n]) for n in sinks) if sinks else 1.0
        out[family] = errs
    return out
