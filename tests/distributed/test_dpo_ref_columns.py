"""Stored reference columns given to `LongDPOTrainer(precompute_ref_log_probs=True)`.

With the reference pass's fingerprint (one process, the saved tiny Llama and a differently
seeded reference of tests/helpers/dpo_cases.py): a dataset scored by the trainer, then edited
(ids changed, a sum edited, sums moved to other rows, rows added, part of the fingerprint
dropped) or reused with another reference, is refused at construction, naming the rows, before
TRL's own preparation runs; whole rows shuffled and filtered stay valid. Without it, on 2 gloo
ranks (Ulysses 2) through the real trainer: the columns of TRL's own `DPOTrainer` pass are used
as given with exactly one warning, on rank 0, naming both datasets and how to verify or drop
them; `verify_ref_logps=4` rescores 4 pairs through the trainer's reference pass, accepts TRL's
columns of this model (the policy, TRL's default reference) and refuses those TRL computed with
the other model's weights, naming each pair's stored and rescored sums (which equal TRL's
columns of this model)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from tests.helpers.dpo_cases import _id_pairs, _text_pairs, paths  # noqa: F401  (paths: a fixture)
from tests.helpers.pool import worker_mesh
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


def _trl_columns(paths, output_dir: str, other_model: bool):
    """TRL's own pass over the 8 text pairs (no fingerprint): the policy's (TRL's default
    reference) or the other model's (ref_model=the differently seeded reference)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOTrainer

    ref = AutoModelForCausalLM.from_pretrained(paths[1], dtype=torch.float32) if other_model else None
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(paths[0], dtype=torch.float32), ref_model=ref,
                         args=_config(output_dir), train_dataset=_text_pairs(8),
                         processing_class=AutoTokenizer.from_pretrained(paths[2]))
    return trainer.train_dataset


def _unfingerprinted(paths, output_dir: str, exact, stale) -> dict:
    """On each rank: the warnings of a trainer given unverified columns; then one trainer with
    verify_ref_logps=4 given this model's columns (train, checked first) and the other model's
    (eval): its refusal, and its warnings."""
    mesh = worker_mesh(2, 1)
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(paths, output_dir + "/warn", mesh, train_dataset=exact, eval_dataset=exact.select(range(4)))
    out["warnings"] = [str(w.message) for w in caught if UNVERIFIED in str(w.message)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            _trainer(paths, output_dir + "/verify", mesh, train_dataset=exact, eval_dataset=stale, verify_ref_logps=4)
            out["stale"] = None
        except ValueError as exc:
            out["stale"] = str(exc)
    out["verified_warnings"] = [str(w.message) for w in caught if UNVERIFIED in str(w.message)]
    return out


def test_unfingerprinted_columns_warn_once_and_verify(pools, paths, tmp_path):
    exact = _trl_columns(paths, str(tmp_path / "trl_exact"), other_model=False)
    stale = _trl_columns(paths, str(tmp_path / "trl_stale"), other_model=True)
    assert not set(FINGERPRINT) & set(exact.column_names)
    out = pools.get(2).run(_unfingerprinted, paths, str(tmp_path / "sp"), exact, stale, timeout=240)
    (first,), rest = out[0]["warnings"], out[1]["warnings"]
    assert not rest, f"rank 1 warned: {rest}"
    for text in ("train_dataset, eval_dataset carry", "verify_ref_logps=64", "remove_columns(['ref_chosen_logps', "):
        assert text in first, first
    for rank, got in enumerate(out):
        assert not got["verified_warnings"], f"rank {rank}: warned although verified: {got['verified_warnings']}"
        message = got["stale"]
        assert message is not None, f"rank {rank}: the other model's columns passed verify_ref_logps=4"
        # train_dataset (this model's columns) was rescored first and accepted; eval_dataset refused
        assert re.search(r"^eval_dataset: [1-4] of 4 rescored pairs disagree(.|\n)*float32 tolerance", message), message
        assert "Do instead: drop them" in message, message
        assert "remove_columns(['ref_chosen_logps', 'ref_rejected_logps'])" in message, message
        named = re.findall(r"pair (\d+): chosen stored (\S+), rescored (\S+) \(off by (\S+),", message)
        assert named, message
        for row, stored, rescored, off in named:
            row = int(row)
            assert float(stored) == pytest.approx(stale[COLUMNS[0]][row], rel=1e-5), (row, message)
            assert float(rescored) == pytest.approx(exact[COLUMNS[0]][row], rel=1e-5), (row, message)
