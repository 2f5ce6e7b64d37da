"""LongContextCollator as a pure function: every rank of a dp × ring × ulysses mesh is
simulated in one process (`SPMesh` without process groups; the layout is pure), each fed
the same global list of documents, as the step sampler guarantees.

Token ids encode (document, position) uniquely and labels are distinct from ids, so each
token found in any shard says where it came from; its target is then checked against the
per-document shift computed here independently. Exact integer comparisons: no tolerance.
"""

from __future__ import annotations

import pytest
import torch

from hf_longctx.data.collator import LongContextCollator
from hf_longctx.data.sharding import SP_METADATA_KEY
from hf_longctx.distributed.mesh import SPMesh

PAD = 0
STRIDE = 1000  # token id = doc * STRIDE + pos + 1: unique while documents stay < STRIDE tokens


def meshes(dp: int, ulysses: int, ring: int, fpdt: int = 1) -> list[list[SPMesh]]:
    """meshes[d] = the SP ranks of DP group d (ulysses fastest)."""
    return [
        [SPMesh(dp=dp, ring=ring, ulysses=ulysses, fpdt_chunks=fpdt, dp_rank=d, ring_rank=r, ulysses_rank=u)
         for r in range(ring) for u in range(ulysses)]
        for d in range(dp)
    ]


def features(lengths: list[int], masked: bool = True) -> list[dict]:
    """Documents with unique token ids; labels distinct from ids, some prompt labels -100."""
    feats = []
    for d, n in enumerate(lengths):
        ids = [d * STRIDE + t + 1 for t in range(n)]
        labels = [500_000 + d * STRIDE + t for t in range(n)]
        if masked and d % 2:
            labels[: n // 3] = [-100] * (n // 3)  # an SFT-style prompt
        feats.append({"input_ids": ids, "labels": labels})
    return feats


def expected_target(feats: list[dict], token: int, piece_end: dict) -> int:
    d, t = divmod(token - 1, STRIDE)
    labels = feats[d].get("labels", feats[d]["input_ids"])
    return labels[t + 1] if t + 1 < piece_end[(d, t)] else -100


def run_all(feats, dp, ulysses, ring, max_tokens, fpdt=1, **kw):
    """{(dp_rank, sp_rank): micro-batches} and the collator of rank 0."""
    out, first = {}, None
    for d, group in enumerate(meshes(dp, ulysses, ring, fpdt)):
        for j, mesh in enumerate(group):
            c = LongContextCollator(mesh, max_tokens, pad_token_id=PAD, **kw)
            out[(d, j)] = c(feats)
            first = first or c
    return out, first


def check_step(feats, dp, ulysses, ring, max_tokens, fpdt=1, **kw):
    shards, collator = run_all(feats, dp, ulysses, ring, max_tokens, fpdt, **kw)
    plan = collator.last_plan
    piece_end = {(p.doc, t): p.end for p in plan.pieces for t in range(p.start, p.end)}
    piece_start = {(p.doc, t): p.start for p in plan.pieces for t in range(p.start, p.end)}
    group = meshes(dp, ulysses, ring, fpdt)
    seen: dict[tuple[int, int], int] = {}
    n_mb = {len(v) for v in shards.values()}
    assert n_mb == {plan.num_microbatches}, f"ranks got different micro-batch counts {n_mb}"  # invariant 8
    for d in range(dp):
        for m in range(plan.num_microbatches):
            mbs = [shards[(d, j)][m] for j in range(len(group[d]))]
            cu = mbs[0][SP_METADATA_KEY].cu_seqlens
            assert len({mb["input_ids"].shape for mb in mbs}) == 1  # invariant 3
            assert all(mb[SP_METADATA_KEY] == mbs[0][SP_METADATA_KEY] for mb in mbs)
            assert cu[-1] <= max_tokens or plan.ranks[d][m] == []
            full_ids = torch.full((cu[-1],), -1)
            for mesh, mb in zip(group[d], mbs):
                assert mb["num_items_in_batch"] == collator.last_num_items
                assert torch.equal(mb["labels"], mb["shift_labels"])
                # Per rank, per local slot: the target sits where its input token sits.
                for tok, lab, pos in zip(mb["input_ids"][0].tolist(), mb["labels"][0].tolist(), mb["position_ids"][0].tolist()):
                    if tok == PAD:
                        assert lab == -100
                        continue
                    key = divmod(tok - 1, STRIDE)
                    seen[key] = seen.get(key, 0) + 1
                    assert lab == expected_target(feats, tok, piece_end), f"token {key}: target {lab}"
                    assert pos == key[1] - piece_start[key], f"token {key}: position {pos}"
                full_ids[mesh.local_indices(cu)] = mb["input_ids"][0]
            assert bool((full_ids >= 0).all()), "the SP shards do not cover the packed row"
            # reassembled: every piece contiguous and in plan order, padding after it
            real = [t for t in full_ids.tolist() if t != PAD]
            want = [feats[p.doc]["input_ids"][t] for i in plan.ranks[d][m] for p in [plan.pieces[i]] for t in range(p.start, p.end)]
            assert real == want
    kept = sorted(piece_end)
    assert sorted(seen) == kept and set(seen.values()) == {1}, "a token is missing or trained twice"
    hand = sum(
        (feats[d].get("labels", feats[d]["input_ids"])[t + 1] != -100)
        for (d, t) in kept if t + 1 < piece_end[(d, t)]
    )
    assert collator.last_num_items == hand
    return shards, collator


@pytest.mark.parametrize("dp,ulysses,ring,fpdt", [(1, 1, 1, 1), (2, 2, 1, 1), (2, 1, 2, 1), (3, 2, 2, 1), (2, 2, 1, 2)])
def test_targets_land_with_their_tokens(dp, ulysses, ring, fpdt):
    feats = features([13, 29, 7, 21, 5, 17, 1, 11])
    _, collator = check_step(feats, dp, ulysses, ring, max_tokens=32, fpdt=fpdt)
    assert collator.last_plan.num_microbatches >= 2  # several micro-batches of unequal size
    assert collator.stats["num_items_in_batch"] == collator.last_num_items
    assert collator.stats["dp_size"] == dp


def test_num_items_hand_count_and_loss_mask():
    mesh = meshes(1, 1, 1)[0][0]
    feats = [
        {"input_ids": [5, 6, 7, 8, 9]},  # default labels: 4 targets
        {"input_ids": [5, 6, 7], "labels": [-100, -100, 7]},  # 1 target
        {"input_ids": [9]},  # 0 targets
    ]
    mbs = LongContextCollator(mesh, 16)(feats)
    assert [mb["num_items_in_batch"] for mb in mbs] == [5] * len(mbs)
    masked = [{"input_ids": [5, 6, 7, 8, 9], "mask": [1, 0, 0, 1, 1]}, {"input_ids": torch.tensor([3, 4]), "mask": [True, True]}]
    c = LongContextCollator(mesh, 16, loss_mask_key="mask")
    (mb,) = c(masked)
    assert c.last_num_items == 3  # tokens 8, 9 of doc 0 and 4 of doc 1
    assert mb["labels"][0].tolist() == [-100, -100, 8, 9, -100, 4, -100]
    check_step([{**f, "labels": [x if m else -100 for x, m in zip(f["input_ids"], f["mask"])]} for f in
                [{"input_ids": [1, 2, 3, 4, 5], "mask": [1, 0, 0, 1, 1]}]], 1, 1, 1, 16)


def test_tensor_and_list_inputs_agree_and_are_deterministic():
    mesh = meshes(2, 1, 2)[1][1]
    feats = features([13, 29, 7, 21, 5])
    as_tensors = [{k: torch.tensor(v) for k, v in f.items()} for f in feats]
    a = LongContextCollator(mesh, 32)(feats)
    b = LongContextCollator(mesh, 32)(as_tensors)
    c = LongContextCollator(mesh, 32)(feats)
    assert len(a) == len(b) == len(c)
    for x, y, z in zip(a, b, c):
        assert x.keys() == y.keys() == z.keys()
        for k in x:
            if isinstance(x[k], torch.Tensor):
                assert torch.equal(x[k], y[k]) and torch.equal(x[k], z[k])
            else:
                assert x[k] == y[k] == z[k]


def test_empty_slots_become_padding_documents():
    feats = features([9], masked=False)  # one document, two DP ranks: rank 1 has nothing to train
    shards, collator = check_step(feats, 2, 2, 1, max_tokens=16)
    for j in range(2):
        (mb,) = shards[(1, j)]
        assert bool((mb["input_ids"] == PAD).all()) and bool((mb["labels"] == -100).all())
        assert mb["num_items_in_batch"] == 8
        assert mb["input_ids"].shape == (1, 1)  # one pad token per Ulysses rank: seq_multiple 2
    assert collator.last_plan.ranks[1] == [[]]


def test_split_and_truncate():
    feats = features([40, 6], masked=False)
    _, c = check_step(feats, 1, 1, 2, max_tokens=16, overlong="split")  # pieces 16, 16, 8 and 6
    assert sorted(p.length for p in c.last_plan.pieces) == [6, 8, 16, 16]
    assert c.last_num_items == 15 + 15 + 7 + 5  # a split boundary loses one target
    _, c = check_step(feats, 1, 1, 2, max_tokens=16, overlong="truncate")
    assert c.last_num_items == 15 + 5  # the tail beyond 16 tokens is gone
    with pytest.raises(ValueError, match="document 0 has 40 tokens"):
        LongContextCollator(meshes(1, 1, 2)[0][0], 16)(feats)


def test_errors():
    mesh = meshes(1, 1, 1)[0][0]
    c = LongContextCollator(mesh, 16)
    with pytest.raises(ValueError, match="feature 1: 'labels' has 2 entries but input_ids has 3"):
        c([{"input_ids": [1, 2]}, {"input_ids": [1, 2, 3], "labels": [1, 2]}])
    with pytest.raises(ValueError, match="must be 1-D"):
        c([{"input_ids": [[1, 2, 3]]}])
    with pytest.raises(ValueError, match="already collated"):
        c({"input_ids": [[1, 2, 3]]})
    with pytest.raises(ValueError, match="feature 0 must be a mapping with 'input_ids'"):
        c([{"ids": [1, 2]}])
    with pytest.raises(ValueError, match="must be integers"):
        c([{"input_ids": [1.0, 2.0]}])
    with pytest.raises(ValueError, match="no valid target"):
        c([{"input_ids": [4]}, {"input_ids": [1, 2], "labels": [-100, -100]}])
    with pytest.raises(ValueError, match="document 1 has length 0"):
        c([{"input_ids": [1, 2]}, {"input_ids": []}])
    with pytest.raises(ValueError, match="token 1 has 2"):
        LongContextCollator(mesh, 16, loss_mask_key="m")([{"input_ids": [1, 2], "m": [1, 2]}])
    with pytest.raises(ValueError, match="has no 'm'"):
        LongContextCollator(mesh, 16, loss_mask_key="m")([{"input_ids": [1, 2]}])
    # planner arguments fail at construction, not at the first step
    with pytest.raises(ValueError, match="strategy must be one of"):
        LongContextCollator(mesh, 16, strategy="greedy")
    with pytest.raises(ValueError, match=r"max_tokens \(2\) must be >= seq_multiple \(4\)"):
        LongContextCollator(meshes(1, 1, 2)[0][0], 2)
    with pytest.raises(ValueError, match="must be an SPMesh"):
        LongContextCollator(object(), 16)
    with pytest.raises(ValueError, match="pad_token_id"):
        LongContextCollator(mesh, 16, pad_token_id=-1)


def test_flex_collator_shares_the_feature_checks():
    """FlexCollator reads features with the same `read_documents` as LongContextCollator:
    the same errors for float ids, 2-D features and label/ids length mismatches."""
    from hf_longctx import init_group_bank
    from hf_longctx.data.cost import CostModel
    from hf_longctx.flex.collator import FlexCollator

    flex = FlexCollator(init_group_bank(heads=4), 64, CostModel(a=1.0, b=1.0))
    with pytest.raises(ValueError, match="input_ids must be integers"):
        flex([{"input_ids": [1.5, 2.0]}])
    with pytest.raises(ValueError, match="must be 1-D"):
        flex([{"input_ids": [[1, 2]]}])
    with pytest.raises(ValueError, match="'labels' has 1 entries but input_ids has 2"):
        flex([{"input_ids": [1, 2], "labels": [1]}])
    out = flex([{"input_ids": [3, 4, 5]}, {"input_ids": [6, 7], "labels": [-100, 7]}])
    assert flex.last_num_items == 3 and len(out) == 1  # targets 4, 5 and 7 (labels shifted per document)


def test_flex_collator_shares_the_option_checks_and_keys():
    """FlexCollator takes LongContextCollator's feature options and checks them alike: a
    negative pad id was accepted before (and padded micro-batches with it); `label_key` and
    `loss_mask_key` now reach the flexible path too."""
    from hf_longctx import init_group_bank
    from hf_longctx.data.cost import CostModel
    from hf_longctx.flex.collator import FlexCollator

    bank, cost = init_group_bank(heads=4), CostModel(a=1.0, b=1.0)
    with pytest.raises(ValueError, match="pad_token_id must be a non-negative int, got -1"):
        FlexCollator(bank, 64, cost, pad_token_id=-1)
    with pytest.raises(ValueError, match="label_key must be a str"):
        FlexCollator(bank, 64, cost, label_key=3)
    flex = FlexCollator(bank, 64, cost, label_key="targets", loss_mask_key="mask")
    fixed = LongContextCollator(meshes(1, 1, 1)[0][0], 64, label_key="targets", loss_mask_key="mask")
    feats = [{"input_ids": [3, 4, 5, 6], "targets": [3, 9, 9, 9], "mask": [1, 1, 0, 1]}, {"input_ids": [6, 7], "mask": [0, 0]}]
    out = flex(feats)
    fixed(feats)
    assert flex.last_num_items == fixed.last_num_items == 2  # targets 9 (pos 1) and 9 (pos 3); pos 2 masked
    assert out[0]["labels"].ne(-100).sum().item() == 2
    with pytest.raises(ValueError, match="no valid target"):
        flex([{"input_ids": [6, 7], "mask": [0, 0]}])


def _pad_rows(feats: list[dict], width: int, side: str) -> list[dict]:
    """Rows padded to `width` with PAD at `side`, every per-token column alike (labels with the
    pad id: a target, were the pads kept), plus their `attention_mask`."""
    def pad(row: list, n: int, value: int) -> list:
        return row + [value] * n if side == "right" else [value] * n + row

    out = []
    for f in feats:
        n = width - len(f["input_ids"])
        out.append({"input_ids": pad(f["input_ids"], n, PAD), "labels": pad(f["labels"], n, PAD),
                    "loss_mask": pad([1] * len(f["input_ids"]), n, 1), "attention_mask": pad([1] * len(f["input_ids"]), n, 0)})
    return out


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_rows_are_their_real_tokens(side):
    """Rows padded to 40 with their `attention_mask`: the fixed-degree and the flexible collator
    pack exactly the micro-batches of the unpadded rows (same tokens, labels, positions, count);
    a mask with a hole, padding at both ends, a value other than 0/1 or no 1 at all is refused
    naming the row."""
    from hf_longctx import init_group_bank
    from hf_longctx.data.cost import CostModel
    from hf_longctx.errors import NotSupported
    from hf_longctx.flex.collator import FlexCollator

    feats = features([7, 30, 12, 19])
    padded = _pad_rows(feats, 40, side)
    mesh = meshes(1, 1, 1)[0][0]
    bank, cost = init_group_bank(heads=4), CostModel(a=1.0, b=1.0)
    for make in (lambda: LongContextCollator(mesh, 64, pad_token_id=PAD, loss_mask_key="loss_mask"),
                 lambda: FlexCollator(bank, 64, cost, pad_token_id=PAD, loss_mask_key="loss_mask")):
        plain, masked = make(), make()
        want = plain([{**f, "loss_mask": [1] * len(f["input_ids"])} for f in feats])
        got = masked(padded)
        assert masked.last_num_items == plain.last_num_items and len(got) == len(want)
        for a, b in zip(got, want):
            for key in ("input_ids", "labels", "position_ids"):
                assert torch.equal(a[key], b[key]), (key, a[key], b[key])
    collate = LongContextCollator(mesh, 64, pad_token_id=PAD)
    for mask, needle in (([1, 1, 0, 1, 0], "not right or left padding: its 5 entries form 4 runs"),
                         ([0, 1, 1, 1, 0], "not right or left padding: its 5 entries form 3 runs"),
                         ([1, 1, 2, 0, 0], "must be 0/1 (1 = a real token, 0 = padding), token 2 has 2"),
                         ([0, 0, 0, 0, 0], "has no 1 in its 5 entries")):
        with pytest.raises(NotSupported) as info:
            collate([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6, 7, 8], "attention_mask": mask}])
        assert str(info.value).startswith("feature 1: 'attention_mask' ") and needle in str(info.value), str(info.value)
        assert "Do instead" in str(info.value)


def test_float_labels_and_targetless_steps_say_the_fix():
    """Float labels were truncated by `.long()` (2.5 -> 2) and trained; now refused with the cast.
    A step without a target, and float ids, name the fix too."""
    from hf_longctx.errors import NotSupported

    collate = LongContextCollator(meshes(1, 1, 1)[0][0], 64, pad_token_id=PAD)
    with pytest.raises(NotSupported, match=r"feature 0: 'labels' must be integers .* got dtype torch.float32") as info:
        collate([{"input_ids": [1, 2, 3], "labels": [1.0, 2.5, 3.0]}])
    assert "cast_column('labels', datasets.Sequence(datasets.Value('int64')))" in str(info.value)
    with pytest.raises(NotSupported, match="input_ids must be integers") as info:
        collate([{"input_ids": [1.0, 2.0]}])
    assert "cast_column('input_ids'" in str(info.value)
    with pytest.raises(NotSupported, match="no valid target") as info:
        collate([{"input_ids": [1, 2, 3], "labels": [1, -100, -100]}])
    assert "dataset.filter(" in str(info.value)
