"""shard_batch / gather_sequence as pure functions: every rank of a mesh is simulated in one
process (`SPMesh` without process groups; `local_indices` is pure), and the union of the
shards is checked against the invariants computed independently here:
shift per document on the full sequence, padding at each document's end and as a trailing
document, positions continuing, one permutation for every per-token tensor, equal shard
sizes, num_items_in_batch = valid targets. Exact integer comparisons: no tolerance.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import DataCollatorWithFlattening

from hf_longctx.data.sharding import SP_METADATA_KEY, shard_batch
from hf_longctx.distributed.gather import gather_sequence
from hf_longctx.distributed.mesh import SPMesh

MESHES = [(1, 1, 1), (2, 2, 1), (4, 1, 1), (1, 4, 1), (2, 1, 3)]  # (ulysses, ring, fpdt_chunks)


def rank_meshes(ulysses: int, ring: int, fpdt: int = 1) -> list[SPMesh]:
    return [
        SPMesh(dp=1, ring=ring, ulysses=ulysses, fpdt_chunks=fpdt, dp_rank=0, ring_rank=r, ulysses_rank=u)
        for r in range(ring)
        for u in range(ulysses)
    ]


def packed(lengths: list[int], seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    feats = [{"input_ids": torch.randint(1, 100, (n,), generator=g).tolist()} for n in lengths]
    return DataCollatorWithFlattening(return_position_ids=True, return_tensors="pt")(feats)


def reassemble(shards: list[dict], meshes: list[SPMesh], key: str) -> torch.Tensor:
    """Put every rank's shard back at its global positions (independent of gather_sequence)."""
    cu = shards[0][SP_METADATA_KEY].cu_seqlens
    b = shards[0][key].shape[0]
    full = torch.full((b, cu[-1]), -999, dtype=torch.long)
    for shard, mesh in zip(shards, meshes):
        full[:, mesh.local_indices(cu)] = shard[key]
    return full


def expected_padded(lengths: list[int], batch: dict, dm: int, sm: int, pad_id: int):
    """The padded global row, built token by token."""
    ids, lab, pos = [], [], []
    start = 0
    for n in lengths:
        doc_ids = batch["input_ids"][0, start : start + n].tolist()
        doc_lab = batch["labels"][0, start : start + n].tolist()
        doc_pos = batch["position_ids"][0, start : start + n].tolist()
        extra = (-n) % dm
        ids += doc_ids + [pad_id] * extra
        lab += doc_lab[1:] + [-100] + [-100] * extra  # token t predicts t+1 of its own document
        pos += doc_pos + [doc_pos[-1] + k for k in range(1, extra + 1)]
        start += n
    tail = (-len(ids)) % sm
    ids += [pad_id] * tail
    lab += [-100] * tail
    pos += list(range(tail))
    return torch.tensor([ids]), torch.tensor([lab]), torch.tensor([pos])


@pytest.mark.parametrize("ulysses,ring,fpdt", MESHES)
def test_packed_batch_invariants(ulysses, ring, fpdt):
    lengths = [7, 23, 5, 14]
    batch = packed(lengths)
    meshes = rank_meshes(ulysses, ring, fpdt)
    shards = [shard_batch(batch, m, pad_token_id=3) for m in meshes]
    sizes = {s["input_ids"].shape[1] for s in shards}
    assert len(sizes) == 1, f"unequal shard sizes {sizes}"  # invariant 3
    ids, lab, pos = expected_padded(lengths, batch, meshes[0].doc_multiple, meshes[0].seq_multiple, 3)
    assert torch.equal(reassemble(shards, meshes, "input_ids"), ids)
    assert torch.equal(reassemble(shards, meshes, "shift_labels"), lab)
    assert torch.equal(reassemble(shards, meshes, "labels"), lab)  # labels are the pre-shifted targets too
    assert torch.equal(reassemble(shards, meshes, "position_ids"), pos)
    valid = int((lab != -100).sum())
    assert valid == sum(lengths) - len(lengths)  # exactly one target lost per document, none per shard
    assert all(s["num_items_in_batch"] == valid for s in shards)
    assert all(s["shift_labels"].is_contiguous() and s["labels"].is_contiguous() for s in shards)
    assert len({s[SP_METADATA_KEY] for s in shards}) == 1  # the metadata is identical on every rank


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 20), min_size=1, max_size=5),
    mesh=st.sampled_from(MESHES),
    seed=st.integers(0, 1000),
)
def test_property_every_token_once_and_targets_preserved(lengths, mesh, seed):
    assume(max(lengths) >= 2)  # one-token documents only have no target at all (refused, tested below)
    batch = packed(lengths, seed)
    meshes = rank_meshes(*mesh)
    shards = [shard_batch(batch, m) for m in meshes]
    ids, lab, pos = expected_padded(lengths, batch, meshes[0].doc_multiple, meshes[0].seq_multiple, 0)
    assert torch.equal(reassemble(shards, meshes, "input_ids"), ids)
    assert torch.equal(reassemble(shards, meshes, "shift_labels"), lab)
    assert torch.equal(reassemble(shards, meshes, "position_ids"), pos)
    info = shards[0][SP_METADATA_KEY]
    # source_positions maps the user's tokens into the padded row
    assert torch.equal(ids[0, info.source_positions()], batch["input_ids"][0])


def test_plain_rows_with_right_padding():
    mesh = rank_meshes(2, 2)
    ids = torch.arange(1, 21).reshape(2, 10)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0
    labels = ids.clone()
    labels[1, 7:] = -100
    extra = torch.rand(2, 10)  # e.g. per-token loss weights: sharded with the same permutation
    shards = [shard_batch({"input_ids": ids, "labels": labels, "attention_mask": mask, "weights": extra}, m) for m in mesh]
    cu = shards[0][SP_METADATA_KEY].cu_seqlens
    assert cu == (0, 12)  # each row one document, padded to a multiple of seq_multiple = 4
    full_lab = reassemble(shards, mesh, "shift_labels")
    assert full_lab[0, :9].tolist() == list(range(2, 11)) and full_lab[0, 9:].eq(-100).all()
    assert full_lab[1, :6].tolist() == list(range(12, 18)) and full_lab[1, 6:].eq(-100).all()
    assert reassemble(shards, mesh, "position_ids")[1].tolist() == list(range(12))
    assert "attention_mask" not in shards[0]
    w = torch.zeros(2, 12)
    for s, m in zip(shards, mesh):
        w[:, m.local_indices(cu)] = s["weights"]
    assert torch.equal(w[:, :10], extra) and w[:, 10:].eq(0).all()
    assert shards[0]["num_items_in_batch"] == 9 + 6


def test_gather_sequence_world1_restores_original_order():
    mesh = rank_meshes(1, 1)[0]
    batch = packed([3, 5, 2])
    shard = shard_batch(batch, mesh)
    hidden = shard["input_ids"][..., None].float() * torch.ones(1, 1, 4)  # [B, S_local, 4]
    back = gather_sequence(hidden, shard, mesh)
    assert torch.equal(back[..., 0].long(), batch["input_ids"])


def test_num_items_passthrough_and_refusals():
    mesh = rank_meshes(1, 2)[0]
    batch = packed([4, 6])
    assert shard_batch(batch, mesh, num_items_in_batch=123)["num_items_in_batch"] == 123
    assert shard_batch(batch, mesh, num_items_in_batch=torch.tensor(77))["num_items_in_batch"] == 77
    with pytest.raises(ValueError, match="positive int"):
        shard_batch(batch, mesh, num_items_in_batch=0)
    with pytest.raises(ValueError, match="every label is -100"):
        shard_batch({**batch, "labels": torch.full_like(batch["labels"], -100)}, mesh)
    with pytest.raises(ValueError, match="left padding"):
        shard_batch({"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])}, mesh)
    with pytest.raises(ValueError, match="must be -100"):
        shard_batch({"input_ids": torch.ones(1, 4, dtype=torch.long), "labels": torch.ones(1, 4, dtype=torch.long),
                     "attention_mask": torch.tensor([[1, 1, 0, 0]])}, mesh)
    with pytest.raises(ValueError, match="ONE row"):
        shard_batch({"input_ids": torch.ones(2, 4, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]])}, mesh)
    with pytest.raises(ValueError, match="per-token"):
        shard_batch({**batch, "pixel_values": torch.zeros(3, 3)}, mesh)
    with pytest.raises(ValueError, match="no 'labels'"):
        shard_batch({"input_ids": batch["input_ids"]}, mesh, num_items_in_batch=5)


def test_flash_kwargs_boundaries_are_consumed():
    mesh = rank_meshes(1, 2)[0]
    feats = [{"input_ids": list(range(1, n + 1))} for n in (3, 5)]
    batch = DataCollatorWithFlattening(return_position_ids=True, return_flash_attn_kwargs=True, return_seq_idx=True, return_tensors="pt")(feats)
    shard = shard_batch(batch, mesh)
    assert shard[SP_METADATA_KEY].cu_seqlens == (0, 4, 12)  # 3 -> 4 and 5 -> 8 tokens (doc_multiple 4)
    assert not {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"} & set(shard)


def test_metadata_with_device_cache_survives_fsdp2_input_cast():
    """FSDP2's forward pre-hook casts the model's inputs with torch.distributed.utils._apply_to_tensors,
    which rebuilds every dataclass with `dataclasses.replace(dc, **every_field)`: the metadata's
    device cache is not a field, so the rebuild works, keeps the metadata and starts an empty cache."""
    from torch.distributed.utils import _apply_to_tensors

    from hf_longctx.data.sharding import SPBatchInfo

    info = SPBatchInfo(cu_seqlens=(0, 3, 8), source_cu_seqlens=(0, 3, 7), rows=1, fingerprint=5)
    info.device_cache["ids"] = torch.tensor([0, 0, 0, 1])
    cast = _apply_to_tensors(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t, {SP_METADATA_KEY: info})
    assert cast[SP_METADATA_KEY] == info and cast[SP_METADATA_KEY].device_cache == {}
    assert list(info.device_cache) == ["ids"]
