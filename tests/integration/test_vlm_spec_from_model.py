"""The multimodal data entry points take the VisionSpec from the patched model, and a row that
holds several documents without boundaries is refused.

- `patch()` remembers the model's VisionSpec; `shard_multimodal(batch, mesh, model=model)` and
  `MultimodalCollator(mesh, max_tokens, model=model)` give the same shards as with the explicit
  `vision_spec(model)`; an explicit spec that contradicts the model's, and an unpatched
  `model=`, are refused naming both sides and the fix;
- a packed row without position_ids / cu_seq_lens_q holding the model's BOS between its
  content (two documents, each starting with BOS) is refused naming the row, the token, its
  position and the fix; with position_ids restarting per document the same row shards; a
  collator feature holding two documents is refused naming the feature.
One process, a mesh of one rank (no collective), tiny models built from configs.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.vlm_cases import build, mixed_documents, packed_row

BOS = 1  # vlm_cases' text configs: pad 0, bos 1, eos 2


@pytest.fixture(scope="module")
def patched():
    from hf_longctx import init_sequence_parallel, patch

    mesh = init_sequence_parallel()
    return mesh, patch(build("qwen2_5_vl"), mesh, unsafe_skip_exactness_check=True)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in ("input_ids", "position_ids", "labels"):
        assert torch.equal(a[k], b[k]), k
    assert torch.equal(a["sp_vision"].plan.recv_order, b["sp_vision"].plan.recv_order)


def test_patch_remembers_the_spec_and_the_data_stage_takes_it(patched):
    from hf_longctx import vision_spec
    from hf_longctx.data.multimodal.collator import MultimodalCollator
    from hf_longctx.data.multimodal.sharding import shard_multimodal
    from hf_longctx.integrations.model_patch import patch_state

    mesh, model = patched
    spec = vision_spec(model)
    assert patch_state(model).vision_spec is spec and spec == vision_spec(build("qwen2_5_vl"))
    row = packed_row(mixed_documents("qwen2_5_vl"))
    _same(shard_multimodal(row, mesh, model=model), shard_multimodal(row, mesh, spec))
    _same(shard_multimodal(row, mesh, spec, model=model), shard_multimodal(row, mesh, spec))  # agreeing: fine
    docs = mixed_documents("qwen2_5_vl")
    by_model, by_spec = MultimodalCollator(mesh, 96, model=model)(docs), MultimodalCollator(mesh, 96, spec)(docs)
    assert len(by_model) == len(by_spec)
    for a, b in zip(by_model, by_spec):
        _same(a, b)


def test_a_contradictory_spec_and_an_unpatched_model_are_refused(patched):
    from hf_longctx import vision_spec
    from hf_longctx.data.multimodal.collator import MultimodalCollator
    from hf_longctx.data.multimodal.sharding import shard_multimodal

    mesh, model = patched
    other = vision_spec(build("gemma3"))
    row = packed_row(mixed_documents("qwen2_5_vl"))
    with pytest.raises(ValueError, match=r"spec \(gemma3\) contradicts the VisionSpec patch\(\) remembered on model= "
                                         r"\(qwen2_5_vl\)(.|\n)*pass only model="):
        shard_multimodal(row, mesh, other, model=model)
    with pytest.raises(ValueError, match=r"MultimodalCollator: spec \(gemma3\) contradicts"):
        MultimodalCollator(mesh, 96, other, model=model)
    with pytest.raises(ValueError, match=r"carries no VisionSpec: it is not patched.*hf_longctx.patch\(model, mesh\)"):
        shard_multimodal(row, mesh, model=build("qwen2_5_vl"))
    with pytest.raises(ValueError, match=r"needs the model's VisionSpec: pass model="):
        shard_multimodal(row, mesh)


def _two_documents_with_bos():
    docs = mixed_documents("qwen2_5_vl")[:2]
    for d in docs:
        d["input_ids"] = torch.cat([torch.tensor([BOS]), d["input_ids"]])
    return docs


def test_a_row_of_several_documents_without_boundaries_is_refused(patched):
    from hf_longctx.data.multimodal.collator import MultimodalCollator
    from hf_longctx.data.multimodal.sharding import shard_multimodal

    mesh, model = patched
    docs = _two_documents_with_bos()
    row = packed_row(docs)
    second = len(docs[0]["input_ids"])  # the second document's BOS
    bare = {k: v for k, v in row.items() if k != "position_ids"}
    with pytest.raises(ValueError, match=rf"row 0 of the batch .* holds several documents but carries no boundaries: "
                                         rf"token id\(s\) \[{BOS}\] .* at position\(s\) \[{second}\](.|\n)*Do instead: pass "
                                         r"position_ids restarting at 0"):
        shard_multimodal(bare, mesh, model=model)
    shard_multimodal(row, mesh, model=model)  # the same row with its boundaries
    one = {k: v for k, v in packed_row(docs[:1]).items() if k != "position_ids"}
    shard_multimodal(one, mesh, model=model)  # one document: a leading BOS is no boundary
    glued = {"input_ids": bare["input_ids"][0], **{k: v for k, v in bare.items() if k not in ("input_ids", "labels")}}
    with pytest.raises(ValueError, match=r"feature 1 \(\d+ tokens\) holds several documents(.|\n)*Do instead: pass each document "
                                         r"as a feature of its own"):
        MultimodalCollator(mesh, 256, model=model)([docs[0], glued])
