"""The multimodal data stage without a process group: items, routing, positions, shards, collator.

- `read_row` pairs images and videos with their placeholder tokens and refuses every
  disagreement (count, grid, pixels, a video without its grid, an item across documents);
- `deal` (LPT) keeps every rank's encoder work within the mean plus one unit, and no rank
  encodes the whole micro-batch;
- the exchange plans of all SP ranks, replayed in pure Python, deliver every embedding row to
  the rank and local slot of its placeholder, for zigzag ring, Ulysses, U×R and FPDT layouts;
- M-RoPE positions of a packed row equal the model's own `get_rope_index` run per document;
- shards mask image labels, keep the layout's permutation on every position row, and hold
  only the pixels of the units their rank encodes;
- the collator counts encoder work in the DP plan and refuses an image document longer than
  the token cap.
"""

from __future__ import annotations

import random

import pytest
import torch

from hf_longctx.data.multimodal.items import read_row
from hf_longctx.data.multimodal.routing import deal, exchange_plan, rank_indices
from hf_longctx.data.multimodal.spec import GRID, Modality, VisionCost, VisionSpec
from tests.helpers.vlm_cases import IMAGE, VIDEO, build, document, mixed_documents, packed_row

SPEC = VisionSpec(
    family="toy", layout=GRID, hidden=8, cost=VisionCost(a=1.0, b=10.0), merge=2, frames_separable=True,
    modalities=(Modality("image", IMAGE, "pixel_values", "image_grid_thw", (), 1),
                Modality("video", VIDEO, "pixel_values_videos", "video_grid_thw", (), 2)),
)


class _Mesh:
    """The layout attributes of an SPMesh, for one rank, without process groups."""

    def __init__(self, ulysses, ring, fpdt_chunks=1, rank=0, dp=1, dp_rank=0):
        from hf_longctx import layout

        self.ulysses, self.ring, self.fpdt_chunks, self.dp, self.dp_rank = ulysses, ring, fpdt_chunks, dp, dp_rank
        self.sp = ulysses * ring
        self.sp_rank, self.ring_rank, self.ulysses_rank = rank, rank // ulysses, rank % ulysses
        self.doc_multiple = layout.doc_multiple(ring)
        self.seq_multiple = layout.seq_multiple(ring, ulysses, fpdt_chunks)
        self._layout = layout

    def local_indices(self, cu):
        return self._layout.local_indices(cu, ring=self.ring, ulysses=self.ulysses, ring_rank=self.ring_rank,
                                          ulysses_rank=self.ulysses_rank, fpdt_chunks=self.fpdt_chunks)


def _row(seed=0):
    return packed_row(mixed_documents("qwen2_5_vl", seed))


def _cu(batch):
    pos = batch["position_ids"][0]
    return [0, *((pos[1:] != pos[:-1] + 1).nonzero().flatten() + 1).tolist(), pos.numel()]


# ---- items -------------------------------------------------------------------------------


def test_read_row_pairs_items_with_placeholders_and_splits_video_slices():
    batch = _row()
    vision = read_row(batch, batch["input_ids"][0], _cu(batch), SPEC)
    images = [u for u in vision.units if u.modality == 0]
    video = [u for u in vision.units if u.modality == 1]
    assert [u.grid for u in images] == [(1, 4, 4), (1, 4, 8), (1, 8, 4)]
    assert [u.n_tokens for u in images] == [4, 8, 8]
    assert [u.grid for u in video] == [(1, 4, 4)] * 3 and [u.tokens for u in video] == [(0, 4), (4, 8), (8, 12)]
    assert [u.pixels for u in video] == [(0, 16), (16, 32), (32, 48)]  # a slice's patch rows
    assert [doc for doc, _ in vision.items[0]] == [0, 2, 2]


@pytest.mark.parametrize("change,message", [
    (lambda b: b.update(image_grid_thw=b["image_grid_thw"][:2]), "describes"),  # grids and pixels disagree
    (lambda b: b.update(input_ids=torch.where(b["input_ids"] == IMAGE, 5, b["input_ids"])), "placeholder tokens"),
    (lambda b: b.pop("video_grid_thw"), "without 'video_grid_thw'"),
    (lambda b: b.pop("pixel_values"), "no 'pixel_values'"),
    (lambda b: b.update(image_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 8], [1, 8, 3]])), "not divisible"),
    (lambda b: b.update(position_ids=torch.cat([torch.arange(8), torch.arange(b["input_ids"].shape[1] - 8)])[None]),
     "across the document boundary"),
])
def test_read_row_refuses_inconsistent_inputs(change, message):
    batch = _row()
    change(batch)
    with pytest.raises(ValueError, match=message):
        read_row(batch, batch["input_ids"][0], _cu(batch), SPEC)


# ---- routing -----------------------------------------------------------------------------


def test_deal_is_within_one_unit_of_the_mean():
    rng = random.Random(0)
    for _ in range(200):
        costs = [rng.choice([1, 4, 9, 16, 100]) * rng.random() for _ in range(rng.randint(1, 30))]
        p = rng.choice([2, 3, 4, 8])
        owner = deal(costs, p)
        loads = [sum(c for c, o in zip(costs, owner) if o == r) for r in range(p)]
        assert max(loads) <= sum(costs) / p + max(costs) + 1e-9
        if len(costs) >= p:
            assert max(loads) < sum(costs) or p == 1  # nobody encodes the whole micro-batch
    assert deal([5.0, 5.0, 1.0], 2) == deal([5.0, 5.0, 1.0], 2) == [0, 1, 0]  # deterministic ties


@pytest.mark.parametrize("ulysses,ring,chunks", [(2, 2, 1), (4, 1, 1), (1, 4, 1), (4, 1, 2), (2, 1, 3), (1, 2, 1)])
def test_exchange_plans_deliver_every_row_to_its_placeholder(ulysses, ring, chunks):
    """Replay all ranks' plans: each encoder row carries its token's padded position; after the
    exchange every rank must hold, in local order, exactly the positions of its vision tokens."""
    from hf_longctx.data.multimodal.sharding import shard_multimodal

    batch = _row(seed=3)
    p = ulysses * ring
    shards = [shard_multimodal(batch, _Mesh(ulysses, ring, chunks, rank=r), SPEC) for r in range(p)]
    info = shards[0]["sp_batch"]
    vision = read_row(batch, batch["input_ids"][0], _cu(batch), SPEC)
    src = info.source_positions()
    positions = [src[vision.placeholders[u.modality][u.tokens[0]:u.tokens[1]]] for u in vision.units]
    owner = deal([SPEC.cost(u.patches) for u in vision.units], p)
    indices = rank_indices(info.cu_seqlens, ring, ulysses, chunks)
    plans = [exchange_plan(positions, [u.modality for u in vision.units], owner, indices, r, info.padded_length) for r in range(p)]
    for r in range(p):
        assert plans[r].send_counts == shards[r]["sp_vision"].plan.send_counts
    outputs = [torch.cat([positions[u] for u in range(len(positions)) if owner[u] == r] or [torch.empty(0, dtype=torch.long)])
               for r in range(p)]
    chunks_to = [list(outputs[r][plans[r].send_index].split(list(plans[r].send_counts))) for r in range(p)]
    for d in range(p):
        got = torch.cat([chunks_to[s][d] for s in range(p)])
        assert [len(chunks_to[s][d]) for s in range(p)] == list(plans[d].recv_counts)
        local = got[plans[d].recv_order]
        ids = shards[d]["input_ids"][0]
        want = indices[d][(ids == IMAGE) | (ids == VIDEO)]
        assert torch.equal(local, want), f"rank {d}"
        want_mod = (ids[(ids == IMAGE) | (ids == VIDEO)] == VIDEO).long()
        assert torch.equal(plans[d].local_modality, want_mod)
    assert sum(s["sp_vision"].units for s in shards) == len(vision.units)


# ---- positions and shards -----------------------------------------------------------------


def test_mrope_positions_equal_the_models_own_rule_per_document():
    from hf_longctx.data.multimodal.positions import row_positions
    from hf_longctx.integrations.vision.registry import vision_spec

    model = build("qwen2_5_vl")
    spec = vision_spec(model)
    docs = mixed_documents("qwen2_5_vl", seed=2)
    batch = packed_row(docs)
    ids = batch["input_ids"][0]
    got = row_positions(ids, _cu(batch), read_row(batch, ids, _cu(batch), spec), spec)
    parts = []
    for d in docs:
        mm = torch.zeros_like(d["input_ids"])[None]
        mm[0, d["input_ids"] == IMAGE], mm[0, d["input_ids"] == VIDEO] = 1, 2
        pos, _ = model.model.get_rope_index(d["input_ids"][None], mm, d.get("image_grid_thw"), d.get("video_grid_thw"))
        parts.append(pos[:, 0])
    assert torch.equal(got, torch.cat(parts, 1))
    assert int(got.max()) < len(ids)  # per document: a packed row does not keep counting


def test_shard_masks_image_labels_keeps_the_permutation_and_only_own_pixels():
    from hf_longctx.data.multimodal.sharding import shard_multimodal
    from hf_longctx.integrations.vision.registry import vision_spec

    spec = vision_spec(build("qwen2_5_vl"))
    batch = _row(seed=1)
    ids = batch["input_ids"][0]
    full = None
    encoded = 0
    for r in range(4):
        mesh = _Mesh(2, 2, rank=r)
        shard = shard_multimodal(batch, mesh, spec)
        info = shard["sp_batch"]
        idx = mesh.local_indices(info.cu_seqlens)
        if full is None:
            vision = read_row(batch, ids, _cu(batch), spec)
            full = torch.zeros(3, info.padded_length, dtype=torch.long)
            from hf_longctx.data.multimodal.positions import row_positions

            full[:, info.source_positions()] = row_positions(ids, _cu(batch), vision, spec)
        assert shard["position_ids"].shape == (4, 1, len(idx))
        assert torch.equal(shard["position_ids"][1:, 0], full[:, idx])
        vs = shard["sp_vision"]
        own = sum(0 if x is None else x["pixels"].shape[0] for x in vs.inputs)
        encoded += own
    assert encoded == batch["pixel_values"].shape[0] + batch["pixel_values_videos"].shape[0]
    # no target is an image token: shift_labels never names one
    mesh = _Mesh(1, 1)
    shard = shard_multimodal(batch, mesh, spec)
    assert not bool(((shard["shift_labels"] == IMAGE) | (shard["shift_labels"] == VIDEO)).any())


def test_shard_refuses_mismatched_type_ids_and_3d_positions_without_text_row():
    from hf_longctx.data.multimodal.sharding import shard_multimodal

    batch = _row()
    bad = dict(batch, mm_token_type_ids=torch.zeros_like(batch["input_ids"]))
    with pytest.raises(ValueError, match="mm_token_type_ids disagrees"):
        shard_multimodal(bad, _Mesh(2, 1), SPEC)
    bad = dict(batch, position_ids=torch.zeros(3, 1, batch["input_ids"].shape[1], dtype=torch.long))
    with pytest.raises(ValueError, match="text row first"):
        shard_multimodal(bad, _Mesh(2, 1), SPEC)


def test_processor_rows_are_packed_into_one_row():
    from hf_longctx.data.multimodal.sharding import shard_multimodal

    docs = mixed_documents("qwen2_5_vl")[:2]
    width = max(len(d["input_ids"]) for d in docs)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for b, d in enumerate(docs):
        ids[b, : len(d["input_ids"])], mask[b, : len(d["input_ids"])] = d["input_ids"], 1
    rows = {"input_ids": ids, "attention_mask": mask, "labels": ids.clone(), "pixel_values": docs[0]["pixel_values"],
            "image_grid_thw": docs[0]["image_grid_thw"]}
    packed = packed_row(docs)
    a, b = shard_multimodal(rows, _Mesh(1, 1), SPEC), shard_multimodal(packed, _Mesh(1, 1), SPEC)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["shift_labels"], b["shift_labels"])
    assert a["sp_batch"].cu_seqlens == b["sp_batch"].cu_seqlens


# ---- collator ----------------------------------------------------------------------------


def test_collator_balances_encoder_work_and_refuses_an_overlong_image_document():
    from hf_longctx.data.multimodal.collator import MultimodalCollator

    g = torch.Generator().manual_seed(0)
    heavy = [document("qwen2_5_vl", g, 2, images=[(1, 16, 16)]) for _ in range(2)]  # 71 tokens, much encoder work
    light = [document("qwen2_5_vl", g, 142)]  # the two heavy documents' tokens in one text document
    spec = VisionSpec(family="toy", layout=GRID, hidden=8, cost=VisionCost(a=0.0, b=1e6), merge=2,
                      modalities=SPEC.modalities[:1])
    from hf_longctx.data.cost import CostModel

    collator = MultimodalCollator(_Mesh(1, 1, dp=2), 512, spec, CostModel(a=0.0, b=1.0), spec.cost)
    def docs_per_rank(plan):
        return [sorted(plan.pieces[p].doc for mb in plan[r] for p in mb) for r in range(2)]

    assert sorted(docs_per_rank(collator.plan(heavy + light))) == [[0, 2], [1]]  # one image-heavy document per rank
    # the same planner blind to encoder work balances tokens: both images on one rank (the test sees the difference)
    blind = MultimodalCollator(_Mesh(1, 1, dp=2), 512, spec, CostModel(a=0.0, b=1.0), VisionCost(0.0, 0.0))
    assert sorted(docs_per_rank(blind.plan(heavy + light))) == [[0, 1], [2]]
    with pytest.raises(ValueError, match=r"longer than the token cap max_tokens=32: \(index, tokens\) \[\(0, 71\)"):
        MultimodalCollator(_Mesh(1, 1), 32, spec, CostModel(a=0.0, b=1.0), spec.cost)(heavy[:1])
    with pytest.raises(ValueError, match="must be given together"):
        MultimodalCollator(_Mesh(1, 1), 32, spec, CostModel(a=0.0, b=1.0))
