"""Token ids outside the model's vocabulary are refused on the host, before any collective,
by every rank alike, naming the document, the position and the id (`data/token_ids.py`).

Every DP rank of a mesh is simulated in one process (a mesh description without groups): the
bad document is planned onto ONE DP rank, yet every rank's collator raises the same error,
because each reads the step's whole global list. The check adds no device synchronisation:
counted with the hot-path counters on host features, as the step DataLoader hands them over.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks._counting import Counter
from hf_longctx import NotSupported
from hf_longctx.data.collator import LongContextCollator
from hf_longctx.data.token_ids import DOCUMENT_KEY, Vocabulary
from hf_longctx.distributed.mesh import SPMesh

VOCAB = Vocabulary(embedding_rows=100, logits=100)


def _mesh(dp: int = 1, dp_rank: int = 0, ulysses: int = 2) -> SPMesh:
    return SPMesh(dp=dp, ring=1, ulysses=ulysses, fpdt_chunks=1, dp_rank=dp_rank, ring_rank=0, ulysses_rank=0)


def _features(bad_doc: int, pos: int, value: int, key: str = "input_ids") -> list[dict]:
    feats = []
    for d in range(4):
        ids = [(d * 7 + t) % 90 + 1 for t in range(6 + d)]
        feat = {"input_ids": ids, DOCUMENT_KEY: f"train_dataset document {40 + d}"}
        if key == "labels":
            feat["labels"] = list(ids)
        feats.append(feat)
    feats[bad_doc][key][pos] = value
    return feats


@pytest.mark.parametrize("value", [100, 12345, -1, -100])
def test_every_dp_rank_names_document_position_and_id(value):
    feats = _features(bad_doc=2, pos=3, value=value)
    messages = []
    for dp_rank in range(2):  # the bad document goes to one DP rank only: both refuse alike
        collator = LongContextCollator(_mesh(dp=2, dp_rank=dp_rank), 32, vocab=VOCAB)
        with pytest.raises(NotSupported) as info:
            collator(feats)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    text = messages[0]
    for needle in ("train_dataset document 42", "position 3", f"token id {value}", "100 rows", "Do instead",
                   "resize_token_embeddings"):
        assert needle in text, f"{needle!r} not in {text}"


def test_labels_outside_the_head_are_refused_and_minus_100_is_not():
    collator = LongContextCollator(_mesh(), 32, vocab=VOCAB)
    with pytest.raises(NotSupported, match=r"document 41, position 5: labels holds 100, neither -100"):
        collator(_features(bad_doc=1, pos=5, value=100, key="labels"))
    with pytest.raises(NotSupported, match=r"position 0: labels holds -7"):
        collator(_features(bad_doc=0, pos=0, value=-7, key="labels"))
    out = collator(_features(bad_doc=1, pos=2, value=-100, key="labels"))  # no loss: accepted
    assert collator.last_num_items == sum(5 + d for d in range(4)) - 1 and out


def test_without_a_document_name_the_feature_is_named():
    feats = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 100]}]
    with pytest.raises(NotSupported, match=r"feature 1, position 2: input_ids holds token id 100"):
        LongContextCollator(_mesh(), 32, vocab=VOCAB)(feats)
    LongContextCollator(_mesh(), 32)(feats)  # without a vocabulary nothing is checked (a user's own ids)


def test_flex_collator_checks_too():
    from hf_longctx import init_group_bank
    from hf_longctx.data.cost import CostModel
    from hf_longctx.flex.collator import FlexCollator

    flex = FlexCollator(init_group_bank(heads=4), 64, CostModel(a=1.0, b=1.0), vocab=VOCAB)
    with pytest.raises(NotSupported, match=r"document 43, position 1: input_ids holds token id 250"):
        flex(_features(bad_doc=3, pos=1, value=250))


def test_pad_token_outside_the_table_is_refused_at_construction():
    with pytest.raises(NotSupported, match=r"pad_token_id=100 lies outside the model's embedding table of 100 rows"):
        LongContextCollator(_mesh(), 32, pad_token_id=100, vocab=VOCAB)


def test_the_check_makes_no_device_sync():
    counter = Counter()
    collator = LongContextCollator(_mesh(), 64, vocab=VOCAB)
    with counter.counting():
        feats = _features(bad_doc=0, pos=0, value=1)  # host rows, as the step DataLoader hands them over
        collator(feats)
    assert counter.counts["syncs"] == 0, counter.sync_sites
    # The counter can see the fault: with features that are device tensors to it (marked as
    # on the device), the same call with the check reads them on the host and is counted.
    device_rows = [{"input_ids": torch.tensor(f["input_ids"])} for f in _features(bad_doc=0, pos=0, value=1)]
    syncs = {}
    for vocab in (None, VOCAB):
        counter = Counter()
        counter.mark_device([row["input_ids"] for row in device_rows])
        with counter.counting():
            LongContextCollator(_mesh(), 64, vocab=vocab)(device_rows)
        syncs[vocab] = counter.counts["syncs"]
    assert syncs[VOCAB] > syncs[None], syncs


def test_dataset_scan_at_construction_names_the_same_row():
    from datasets import Dataset

    from hf_longctx.training.sft.data import check_dataset_token_ids

    ds = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5, 6, 7], [8, 99, 100, 9]]})
    with pytest.raises(NotSupported, match=r"train_dataset document 2, position 2: input_ids holds token id 100"):
        check_dataset_token_ids(ds, VOCAB)
    check_dataset_token_ids(ds.select([0, 1]), VOCAB)
    shuffled = ds.select([2, 0, 1])  # rows are named in the dataset's own (shuffled) order
    with pytest.raises(NotSupported, match=r"train_dataset document 0, position 2"):
        check_dataset_token_ids(shuffled, VOCAB)
    labelled = Dataset.from_dict({"input_ids": [[1, 2, 3]], "labels": [[-100, 2, 130]]})
    with pytest.raises(NotSupported, match=r"document 0, position 2: labels holds 130"):
        check_dataset_token_ids(labelled, VOCAB)
    check_dataset_token_ids(labelled, None)  # no vocabulary known: nothing to check


def test_dpo_pairs_are_checked_per_step():
    from hf_longctx.training.dpo.data import PairStepCollate

    rows = [{"prompt_ids": [1, 2], "chosen_ids": [3, 4], "rejected_ids": [5, 6], DOCUMENT_KEY: f"train_dataset pair {i}"}
            for i in range(3)]
    rows[1]["rejected_ids"] = [5, 101]
    with pytest.raises(NotSupported, match=r"train_dataset pair 1 \(prompt \+ rejected\), position 3: input_ids holds "
                                           r"token id 101"):
        PairStepCollate(_mesh(), 32, vocab=VOCAB)(rows)
