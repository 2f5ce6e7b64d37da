"""Vision-language models under FSDP2 (the Trainer's placement) on 2 gloo ranks vs one process.

transformers returns the encoder features a model merged (`mm_encoder_outputs`, which the vision
hook hands in) in its output (`image_outputs` / `video_outputs`), and FSDP2 registers its
pre-backward hook on every output tensor of the root unit; a view there draws torch's warning that
an in-place op on it would drop the hook (and skip the unit's all-gather in backward). The vision
hook gathers its feature rows by advanced indexing, so none is a view: no such warning, and every
returned feature tensor owns its storage. Loss and every gradient (the full tensors of the
FSDP2-reduced shards) equal the documents run one at a time through transformers in one process
(`tests/helpers/vlm_cases.compare`: fp32 loss 1e-5, gradients 1e-4 of the float64 truth). Qwen2.5-VL
(images and a video) and Qwen3-VL (DeepStack levels: column slices of the exchanged rows), Ulysses 2.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from tests.helpers.pool import worker_mesh


def _fsdp_step(family: str) -> dict:
    from hf_longctx.data.multimodal.sharding import shard_multimodal
    from hf_longctx.distributed.loss import global_loss
    from hf_longctx.integrations.accelerate import fsdp_plan
    from hf_longctx.integrations.model_patch import patch
    from tests.helpers.vlm_cases import build, compare, mixed_documents, packed_row, references

    mesh = worker_mesh(2, 1)
    docs = mixed_documents(family)
    refs = references(family, docs)
    model = patch(build(family), mesh)
    fsdp_plan(model, mesh).apply(model)
    shard = shard_multimodal(packed_row(docs), mesh, model=model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = model(**shard)
        out.loss.backward()
    features = [t for k in ("image_outputs", "video_outputs") if getattr(out, k, None) is not None
                for level in [out[k].pooler_output, *(getattr(out[k], "deepstack_features", None) or [])]
                for t in (level if isinstance(level, (list, tuple)) else [level])]
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    errs = compare(*refs, global_loss(out.loss, mesh), grads)
    errs["view_warnings"] = [str(w.message)[:120] for w in seen if "returned a view tensor" in str(w.message)]
    # a release without the image_outputs / video_outputs fields (5.19) returns no features: none to check
    errs["returns_features"] = "image_outputs" in {f.name for f in dataclasses.fields(type(out))}
    errs["features"] = len(features)
    errs["feature_views"] = sum(t._base is not None for t in features)
    return errs


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_vlm_under_fsdp2_matches_one_process_and_returns_no_views(pools, family):
    for rank, e in enumerate(pools.get(2).run(_fsdp_step, family, timeout=300)):
        msg = f"{family} rank {rank}: {e}"
        assert not e["view_warnings"] and e["feature_views"] == 0, msg
        assert (e["features"] > 0) == e["returns_features"], msg
        assert not e["missing"], msg
        assert e["loss"] <= 1 and e["language"] <= 1 and e["projector"] <= 1 and e["vision"] <= 1, msg
        assert min(e["language_max"], e["projector_max"], e["vision_max"]) > 1e-3, f"a part got no gradient: {msg}"
