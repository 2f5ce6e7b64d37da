"""Tests of the step sampler (data/sampler.py) and the datasets tokenize helper
(data/pipeline.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from datasets import Dataset, IterableDataset
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hf_longctx.data.packing import plan_microbatches
from hf_longctx.data.pipeline import tokenize_dataset
from hf_longctx.data.sampler import StepSampler, group_stream


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(1, 50), min_size=1, max_size=80),
    st.integers(1, 120),
    st.integers(0, 5),
    st.booleans(),
)
def test_epoch_covers_every_document_once_under_budget(lengths, budget, seed, shuffle):
    sampler = StepSampler(lengths, tokens_per_step=budget, seed=seed, shuffle=shuffle)
    steps = list(sampler)
    flat = [i for s in steps for i in s]
    assert sorted(flat) == list(range(len(lengths)))
    for s in steps:
        tokens = sum(lengths[i] for i in s)
        assert tokens <= budget or len(s) == 1, "only a lone over-budget document may exceed"
    # Greedy: the next step's first document would not have fitted.
    for a, b in zip(steps, steps[1:]):
        assert sum(lengths[i] for i in a) + lengths[b[0]] > budget
    if not shuffle:
        assert flat == list(range(len(lengths)))
    assert sampler.epoch == 1 and len(steps) == len(StepSampler(lengths, tokens_per_step=budget, seed=seed, shuffle=shuffle))


def test_same_steps_on_every_rank_and_new_order_each_epoch():
    lengths = np.random.default_rng(0).integers(1, 100, size=500)
    ranks = [StepSampler(lengths, tokens_per_step=1000, seed=7) for _ in range(3)]
    epochs = [[list(s), list(s)] for s in ranks]
    assert epochs[0] == epochs[1] == epochs[2]
    assert epochs[0][0] != epochs[0][1], "epoch 1 reshuffles"
    assert StepSampler(lengths, tokens_per_step=1000, seed=8).epoch_steps(0)[0].tolist() != epochs[0][0][0]


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 40), st.integers(0, 3))
def test_resume_mid_epoch_is_exact(stop_after, seed):
    lengths = np.random.default_rng(seed).integers(1, 64, size=200)
    reference = StepSampler(lengths, tokens_per_step=300, seed=seed)
    # Three passes cover 60 steps from any stop point; a resumed stream continues across epochs.
    expected = list(itertools.islice(itertools.chain(reference, reference, reference), 60))

    first = StepSampler(lengths, tokens_per_step=300, seed=seed)
    it = iter(first)
    seen = [next(it) for _ in range(min(stop_after, len(first)))]
    state = first.state_dict()
    resumed = StepSampler(lengths, tokens_per_step=300, seed=seed)
    resumed.load_state_dict(state)
    resumed.set_epoch(state["epoch"])  # a training loop's set_epoch must not lose the position
    rest = list(itertools.islice(itertools.chain(resumed, resumed, resumed), 60 - len(seen)))
    assert seen + rest == expected


def test_drop_last_and_oversize_document():
    sampler = StepSampler([4, 4, 4, 20, 4], tokens_per_step=8, shuffle=False)
    assert list(sampler) == [[0, 1], [2], [3], [4]]
    sampler = StepSampler([4, 4, 4, 20, 4], tokens_per_step=8, shuffle=False, drop_last=True)
    assert list(sampler) == [[0, 1], [2], [3]]


def test_load_state_dict_rejects_other_settings():
    state = StepSampler([1, 2, 3], tokens_per_step=4, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed: saved 1, here 2"):
        StepSampler([1, 2, 3], tokens_per_step=4, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_documents"):
        StepSampler([1, 2, 3, 4], tokens_per_step=4, seed=1).load_state_dict(state)


@pytest.mark.parametrize(
    "lengths, kwargs, match",
    [
        ([1, 0, 2], dict(tokens_per_step=4), "document 1 has length 0"),
        ([1, 2], dict(tokens_per_step=0), "tokens_per_step"),
        ([1, 2], dict(tokens_per_step=4, seed=-1), "seed"),
        ([1.5, 2], dict(tokens_per_step=4), "integers"),
    ],
)
def test_sampler_errors(lengths, kwargs, match):
    with pytest.raises(ValueError, match=match):
        StepSampler(lengths, **kwargs)


def test_group_stream():
    rows = [{"length": n, "k": i} for i, n in enumerate([3, 3, 3, 9, 1])]
    steps = list(group_stream(iter(rows), tokens_per_step=6))
    assert [[r["k"] for r in s] for s in steps] == [[0, 1], [2], [3], [4]]
    with pytest.raises(ValueError, match="example 0 has no 'length'"):
        list(group_stream([{"x": 1}], tokens_per_step=6))


@pytest.fixture(scope="module")
def char_tokenizer():
    vocab = {"<eos>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


TEXTS = ["hello world", "ab", "", "zzz zzz zzz"]


def test_tokenize_dataset(char_tokenizer):
    ds = Dataset.from_dict({"text": TEXTS, "source": ["a", "b", "c", "d"]})
    out = tokenize_dataset(ds, char_tokenizer, keep_columns=["source"], batch_size=3)
    assert sorted(out.column_names) == ["input_ids", "length", "source"]
    assert out["length"] == [len(t) + 1 for t in TEXTS]
    assert all(ids[-1] == char_tokenizer.eos_token_id for ids in out["input_ids"])
    assert out["input_ids"][1] == [2, 3, 0]  # "a", "b", <eos>
    bare = tokenize_dataset(ds, char_tokenizer, add_eos=False)
    assert bare.column_names == ["input_ids", "length"] and bare["length"] == [len(t) for t in TEXTS]
    # From tokenized lengths to a plan, end to end.
    sampler = StepSampler(out["length"], tokens_per_step=30, seed=0)
    for step in sampler:
        plan = plan_microbatches([out["length"][i] for i in step], dp_size=2, max_tokens=16)
        assert sorted(p.doc for p in plan.pieces) == list(range(len(step)))


def test_tokenize_dataset_shows_one_progress_bar_per_job(char_tokenizer, capfd, monkeypatch):
    """N launched processes tokenizing alike print one `datasets` bar (the first process's), and
    the global progress-bar switch is left as it was."""
    from datasets.utils import are_progress_bars_disabled

    ds = Dataset.from_dict({"text": TEXTS})
    for rank, shown in (("0", True), ("1", False), (None, True)):
        if rank is None:
            monkeypatch.delenv("RANK", raising=False)
        else:
            monkeypatch.setenv("RANK", rank)
        out = tokenize_dataset(ds, char_tokenizer)
        assert ("Map" in capfd.readouterr().err) is shown, rank
        assert out["length"] == [len(t) + 1 for t in TEXTS] and not are_progress_bars_disabled()
    monkeypatch.setenv("RANK", "0")
    tokenize_dataset(ds, char_tokenizer, progress=False)
    assert "Map" not in capfd.readouterr().err


def test_tokenize_iterable_dataset(char_tokenizer):
    ds = IterableDataset.from_generator(lambda: ({"text": t} for t in TEXTS))
    out = tokenize_dataset(ds, char_tokenizer, batch_size=2)
    rows = list(out)
    assert [r["length"] for r in rows] == [len(t) + 1 for t in TEXTS]
    assert all("text" not in r for r in rows)
    steps = list(group_stream(out, tokens_per_step=13))
    assert [len(s) for s in steps] == [1, 2, 1]  # lengths 12 | 3 1 | 12


def test_tokenize_errors(char_tokenizer):
    ds = Dataset.from_dict({"body": ["x"]})
    with pytest.raises(ValueError, match=r"no column\(s\) \['text'\]"):
        tokenize_dataset(ds, char_tokenizer)
    no_eos = PreTrainedTokenizerFast(tokenizer_object=char_tokenizer.backend_tokenizer)
    with pytest.raises(ValueError, match="no eos_token_id"):
        tokenize_dataset(ds, no_eos, text_column="body")


def test_resume_saved_right_after_the_last_step_of_an_epoch():
    # A training loop checkpoints right after each step; after an epoch's last step the
    # state is (epoch, len): resuming from it must continue with the next epoch's first step.
    lengths = [5, 5, 5, 5]
    a = StepSampler(lengths, tokens_per_step=10, seed=3)
    it = iter(a)
    epoch0 = [next(it) for _ in range(len(a))]  # the whole epoch 0; the generator is not resumed
    assert len(epoch0) == 2
    state = a.state_dict()
    b = StepSampler(lengths, tokens_per_step=10, seed=3)
    b.load_state_dict(state)
    expected = [s.tolist() for s in StepSampler(lengths, tokens_per_step=10, seed=3).epoch_steps(1)]
    assert next(iter(b)) == expected[0]


def test_document_lengths_reads_arrow_and_respects_selection():
    """Without a `length` column the lengths come from Arrow; a shuffled selection of the
    dataset gives the lengths of exactly those rows, in that order."""
    from datasets import Dataset

    from hf_longctx.training.sft.data import document_lengths

    ds = Dataset.from_dict({"input_ids": [[1] * (i % 9 + 1) for i in range(50)]}).shuffle(seed=3).select(range(5, 30))
    assert document_lengths(ds) == [len(ids) for ids in ds["input_ids"]]
