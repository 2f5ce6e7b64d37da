"""`training/grpo/microbatches.py` without processes: the plan under the cap, the split to the
world's agreed count (the MAX all-reduce stubbed), the overlong refusal and the metric merge."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from hf_longctx.training.grpo import microbatches as gm

ONE = SimpleNamespace(world_size=1, sp=1, doc_multiple=1, seq_multiple=1)


def test_plan_rows_every_row_once_under_the_cap():
    lengths = [7, 3, 12, 5, 9, 2, 11]
    bins = gm.plan_rows(lengths, ONE, 16)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert len(bins) >= math.ceil(sum(lengths) / 16) and all(sum(lengths[i] for i in b) <= 16 for b in bins), bins
    assert gm.plan_rows(lengths, ONE, None) == [list(range(len(lengths)))]  # no cap: one micro-batch


def test_plan_rows_splits_to_the_agreed_count(monkeypatch):
    """Another DP group planned 5 micro-batches: this group's 2 become 5 non-empty ones."""
    world = SimpleNamespace(world_size=2, sp=1, doc_multiple=1, seq_multiple=1, world_mesh=SimpleNamespace(get_group=lambda: None))

    def all_reduce(t, op=None, group=None):
        t[0] = max(int(t[0]), 5)

    monkeypatch.setattr(gm.dist, "all_reduce", all_reduce)
    lengths = [4, 4, 4, 4, 4, 4]
    bins = gm.plan_rows(lengths, world, 12)
    assert len(bins) == 5 and all(bins) and sorted(i for b in bins for i in b) == list(range(6)), bins


def test_plan_rows_overlong_row_named():
    mesh = SimpleNamespace(world_size=1, sp=1, doc_multiple=4, seq_multiple=1)
    with pytest.raises(ValueError, match=r"prompt\+completion of 20 tokens .*max_tokens=18"):
        gm.plan_rows([5, 17, 3], mesh, 18)  # 17 padded to 20 > 18


def test_merge_metrics_weights_by_tokens():
    parts = [{"entropy": 1.0, "clip_ratio/low_min": float("nan"), "clip_ratio/high_max": 0.5},
             {"entropy": 4.0, "clip_ratio/low_min": 0.25, "clip_ratio/high_max": float("nan")}]
    got = gm.merge_metrics(parts, [3.0, 1.0])
    assert got["entropy"] == pytest.approx((3 * 1.0 + 1 * 4.0) / 4)
    assert got["clip_ratio/low_min"] == 0.25 and got["clip_ratio/high_max"] == 0.5
    both_nan = gm.merge_metrics([{"clip_ratio/low_min": float("nan")}] * 2, [1.0, 1.0])
    assert math.isnan(both_nan["clip_ratio/low_min"])


def test_merge_metrics_weights_token_and_completion_means():
    """Token means by each slot's completion tokens, the named per-completion means by each slot's
    completions, clip extremes as nanmin / nanmax."""
    parts = [{"entropy": 1.0, "clip_ratio/low_mean": 0.5, "clip_ratio/low_min": float("nan")},
             {"entropy": 4.0, "clip_ratio/low_mean": 0.0, "clip_ratio/low_min": 0.25}]
    got = gm.merge_metrics(parts, [3.0, 1.0], sequences=[1.0, 3.0], per_sequence=("clip_ratio/low_mean",))
    assert got == {"entropy": (3 + 4) / 4, "clip_ratio/low_mean": 0.5 / 4, "clip_ratio/low_min": 0.25}
    assert gm.merge_metrics(parts, [3.0, 1.0])["clip_ratio/low_mean"] == 1.5 / 4  # unnamed: a token mean
