"""DPOConfig classification (training/refusals/dpo.py): every field classified, refusals
name the value and what to do instead, an unclassified field is refused when set."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import TrainingArguments
from trl import DPOConfig

from hf_longctx.errors import NotSupported
from hf_longctx.training.refusals import dpo as dpo_arguments
from hf_longctx.training.refusals.dpo import DPO_CONFIG, check_dpo_config, refused_dpo_fields


def _config(tmp_path, **kw):
    return DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_length=None, **kw)


def test_every_dpo_config_field_is_classified():
    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    own = {f.name for f in dataclasses.fields(DPOConfig)} - base
    assert own - set(DPO_CONFIG) == set(), "classify these DPOConfig fields in DPO_CONFIG"
    assert set(DPO_CONFIG) - own == set(), "DPO_CONFIG names fields DPOConfig no longer has"


def test_defaults_with_max_length_none_are_accepted(tmp_path):
    assert refused_dpo_fields(_config(tmp_path)) == []
    check_dpo_config(_config(tmp_path, loss_type="ipo", beta=0.3))


@pytest.mark.parametrize("kw,needle", [
    (dict(padding_free=True), "padding_free=True"),
    (dict(loss_type=["sigmoid", "sft"]), "loss_type="),
    (dict(loss_type="robust"), "loss_type="),
    (dict(use_weighting=True), "use_weighting=True"),
    (dict(ld_alpha=0.5), "ld_alpha=0.5"),
    (dict(sync_ref_model=True), "sync_ref_model=True"),
    (dict(precompute_ref_batch_size=4), "precompute_ref_batch_size=4"),
])
def test_refusals_name_value_and_do_instead(tmp_path, kw, needle):
    with pytest.raises(NotSupported) as e:
        check_dpo_config(_config(tmp_path, **kw))
    assert needle in str(e.value) and "do instead" in str(e.value).lower()


def test_precompute_ref_log_probs_is_honoured(tmp_path):
    assert refused_dpo_fields(_config(tmp_path, precompute_ref_log_probs=True)) == []


def test_default_max_length_is_refused(tmp_path):
    errors = refused_dpo_fields(DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True))
    assert any(e.startswith("DPOConfig.max_length=1024") for e in errors)


def test_unclassified_field_is_refused_when_set(tmp_path, monkeypatch):
    monkeypatch.delitem(dpo_arguments.DPO_CONFIG, "beta")
    assert any("beta=0.5" in e and "not classified" in e for e in refused_dpo_fields(_config(tmp_path, beta=0.5)))
    assert refused_dpo_fields(_config(tmp_path)) == []  # at its default it passes


@pytest.mark.parametrize("name, value", [("max_tokens_per_rank", 64), ("unequal_calls", True), ("overlong", "split")])
def test_trainer_refuses_what_pairs_cannot_do(tmp_path, name, value):
    """LongDPOTrainer's keyword arguments that would split, truncate or regroup a pair are
    refused with the config and mesh checks, before the model is looked at."""
    from hf_longctx import init_sequence_parallel
    from hf_longctx.training.dpo.checks import check_dpo_trainer

    with pytest.raises(NotSupported, match=f"LongDPOTrainer: {name} is not supported(.|\n)*use max_tokens"):
        check_dpo_trainer(None, _config(tmp_path), init_sequence_parallel(), {name: value})
    with pytest.raises(NotSupported, match="mesh must be an SPMesh"):
        check_dpo_trainer(None, _config(tmp_path), "mesh", {name: value})
