"""Pairs as planning units (data/pairs.py): never separated, every pair planned once."""

from __future__ import annotations

import pytest
import torch

from hf_longctx.data.pairs import pack_pairs, plan_pairs


def test_every_pair_planned_once_within_budget():
    g = torch.Generator().manual_seed(0)
    chosen = torch.randint(5, 40, (23,), generator=g).tolist()
    rejected = torch.randint(5, 40, (23,), generator=g).tolist()
    plan = plan_pairs(chosen, rejected, dp_size=2, max_tokens=128, doc_multiple=4, seq_multiple=8)
    seen = sorted(plan.pieces[i].doc for rank in plan.ranks for mb in rank for i in mb)
    assert seen == list(range(23))
    assert all(p.start == 0 for p in plan.pieces)  # never split
    for rank in plan.ranks:
        for mb in rank:
            used = sum(-(-chosen[plan.pieces[i].doc] // 4) * 4 + -(-rejected[plan.pieces[i].doc] // 4) * 4 for i in mb)
            assert used <= 128


def test_overlong_pair_raises_and_cannot_be_split():
    with pytest.raises(ValueError):
        plan_pairs([100], [100], dp_size=1, max_tokens=128)
    with pytest.raises(ValueError, match="cannot be split"):
        plan_pairs([10], [10], dp_size=1, max_tokens=128, overlong="split")


def test_pack_pairs_layout():
    row = pack_pairs([([1, 2], [3, 4, 5], [6]), ([7], [8], [9, 10])])
    assert row["input_ids"].tolist() == [[1, 2, 3, 4, 5, 1, 2, 6, 7, 8, 7, 9, 10]]
    assert row["labels"].tolist() == [[-100, -100, 3, 4, 5, -100, -100, 6, -100, 8, -100, 9, 10]]
    assert row["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 0, 1, 2]]
