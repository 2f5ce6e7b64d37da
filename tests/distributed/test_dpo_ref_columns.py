"""Stored reference columns given to `LongDPOTrainer(precompute_ref_log_probs=True)`.

With the reference pass's fingerprint (one process, the saved tiny Llama and a differently
seeded reference of tests/helpers/dpo_cases.py): a dataset scored by the trainer, then edited
(ids changed, a sum edited, sums moved to other rows, rows added, part of the fingerprint
dropped) or reused with another reference, is refused at construction, naming the rows, before
TRL's own preparation runs; whole rows shuffled and filtered stay valid."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers.dpo_cases import _id_pairs, _text_pairs, paths  # noqa: F401  (paths: a fixture)
from tests.helpers.trainer_cases import trainer_env

COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
FINGERPRINT = ("ref_ids_hash", "ref_model_hash", "ref_logps_hash")
UNVERIFIED = "could not be verified"


def _config(output_dir: str):
    from trl import DPOConfig

    trainer_env()
    return DPOConfig(output_dir=output_dir, max_steps=1, report_to=[], use_cpu=True, disable_tqdm=True,
                     save_strategy="no", seed=0, bf16=False, max_length=None, beta=0.5, precompute_ref_log_probs=True)


def _trainer(paths, output_dir: str, mesh, ref: bool = False, **kw):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_longctx import LongDPOTrainer, patch

    model = patch(AutoModelForCausalLM.from_pretrained(paths[0], dtype=torch.float32), mesh)
    reference = AutoModelForCausalLM.from_pretrained(paths[1], dtype=torch.float32) if ref else None
    return LongDPOTrainer(model=model, ref_model=reference, args=_config(output_dir), mesh=mesh, max_tokens=64,
                          tokens_per_step=4096, processing_class=AutoTokenizer.from_pretrained(paths[2]), **kw)


@pytest.fixture(scope="module")
def scored(paths, tmp_path_factory):
    """8 pairs with the columns and fingerprint the pass writes, scored by the explicit reference."""
    from transformers import AutoTokenizer

    from hf_longctx import init_sequence_parallel

    pairs = _id_pairs(AutoTokenizer.from_pretrained(paths[2]), _text_pairs(8))
    trainer = _trainer(paths, str(tmp_path_factory.mktemp("scored")), init_sequence_parallel(), ref=True,
                       train_dataset=pairs)
    assert set(FINGERPRINT) <= set(trainer.train_dataset.column_names)
    return trainer.train_dataset


def _moved(ds):  # the sums rotated by one row, the fingerprint columns left in place
    rows = ds.remove_columns(list(COLUMNS))
    for c in COLUMNS:
        values = ds[c]
        rows = rows.add_column(c, values[1:] + values[:1])
    return rows


def _added(ds):
    from datasets import concatenate_datasets

    extra = ds.select([0, 1]).map(lambda r: {**{c: None for c in (*COLUMNS, *FINGERPRINT)}})
    return concatenate_datasets([ds, extra.cast(ds.features)])


EDITS = {  # edit of a scored dataset -> what the refusal says
    "ids": (lambda ds: ds.map(lambda r, i: {"chosen_ids": r["chosen_ids"][::-1] if i == 2 else r["chosen_ids"]},
                              with_indices=True), r"token ids that differ(.|\n)*1 pair: pair 2 \(ref_ids_hash"),
    "sum": (lambda ds: ds.map(lambda r, i: {COLUMNS[0]: r[COLUMNS[0]] + (1.0 if i == 3 else 0.0)}, with_indices=True),
            r"stored sums edited(.|\n)*1 pair: pair 3 \(ref_chosen_logps"),
    "moved": (_moved, r"or moved to another row, 8 pairs"),
    "added": (_added, r"rows without a fingerprint or stored sums \(added after the reference pass\), 2 pairs: "
                      r"pair 8, pair 9"),
    "partial": (lambda ds: ds.remove_columns(["ref_logps_hash"]), r"but not \['ref_logps_hash'\]"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_edited_fingerprinted_columns_refused_at_construction(paths, scored, tmp_path, monkeypatch, edit):
    """Each edit is refused by the constructor, before TRL's DPOTrainer.__init__ runs, naming the
    rows, with the fix: drop the columns (the trainer then computes them)."""
    from trl import DPOTrainer

    from hf_longctx import init_sequence_parallel

    change, says = EDITS[edit]
    dataset = change(scored)
    ran = []
    init = DPOTrainer.__init__
    monkeypatch.setattr(DPOTrainer, "__init__", lambda self, *a, **k: ran.append(1) or init(self, *a, **k))
    with pytest.raises(ValueError, match=says) as err:
        _trainer(paths, str(tmp_path), init_sequence_parallel(), ref=True, train_dataset=dataset)
    assert "Do instead: drop the stale columns" in str(err.value) and "remove_columns(" in str(err.value), err.value
    assert not ran, f"{edit}: refused only after TRL's preparation"


def test_columns_of_another_reference_refused(paths, scored, tmp_path):
    """Columns the explicit reference computed, reused with ref_model=None (the policy is then the
    reference): refused naming both digests and the three fixes."""
    from hf_longctx import init_sequence_parallel

    with pytest.raises(ValueError, match=r"sums computed by another reference \(ref_model_hash -?[0-9]+; the initial "
                                         r"policy \(ref_model=None\) digests to -?[0-9]+\), 8 pairs") as err:
        _trainer(paths, str(tmp_path), init_sequence_parallel(), train_dataset=scored)
    assert "pass as ref_model the model that computed them" in str(err.value)


def test_whole_rows_shuffled_and_filtered_stay_valid(paths, scored, tmp_path):
    """Each row keeps its own sums with its ids: used as given, without a warning."""
    from hf_longctx import init_sequence_parallel

    dataset = scored.shuffle(seed=3).filter(lambda r, i: i % 3 != 1, with_indices=True)
    assert 0 < len(dataset) < len(scored)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _trainer(paths, str(tmp_path), init_sequence_parallel(), ref=True, train_dataset=dataset)
    assert trainer.train_dataset[COLUMNS[0]] == dataset[COLUMNS[0]]
    assert not [w for w in caught if UNVERIFIED in str(w.message)]
