"""`DPOConfig(precompute_ref_log_probs=True)` in `LongDPOTrainer` vs TRL's own `DPOTrainer`.

The reference is the REAL, unpatched single-process `trl.DPOTrainer` with
`precompute_ref_log_probs=True` on the same saved tiny Llama, the same 8 pairs in one batch and
the same `DPOConfig` (fp32, plain SGD, constant learning rate). On 4 gloo ranks, U2×R2 with an
explicit reference (non-zero rewards) and dp2×U2 with TRL's default (the initial policy):
the stored `ref_chosen_logps` / `ref_rejected_logps` columns equal TRL's (1e-5 relative: the
same fp32 sums in another order), and one optimizer step gives TRL's loss (1e-5), grad_norm
(1e-4), every gradient (1e-4 of the tensor's max) and logged metrics (1e-5), with no reference
held after construction. Single process: a dataset carrying TRL's columns is used as is (its
values, not recomputed: zeros there change the loss); a format transform is refused at
construction; a row whose token ids change after the pass is refused when the step loader is built;
a dataset passed to `evaluate()` after the reference was released is refused."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.pool import worker_mesh
from tests.helpers.trainer_cases import trainer_env
from tests.helpers.dpo_cases import BETA, _grab_callback, _id_pairs, _text_pairs, paths  # noqa: F401  (paths: a fixture)

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected", "num_tokens", "entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy")
COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")


def _config(output_dir: str):
    from trl import DPOConfig

    trainer_env()
    return DPOConfig(output_dir=output_dir, max_steps=1, learning_rate=1e-2, optim="sgd", lr_scheduler_type="constant",
                     max_grad_norm=1e9, logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True,
                     save_strategy="no", seed=0, bf16=False, max_length=None, beta=BETA, precompute_ref_log_probs=True)


def _result(trainer, grads: dict) -> dict:
    log = next(h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h)
    return {"loss": log["loss"], "grad_norm": log["grad_norm"], "metrics": {k: log[k] for k in METRICS},
            "grads": {n: g.double() for n, g in grads.items()},
            "columns": {c: torch.tensor(trainer.train_dataset[c], dtype=torch.float64) for c in COLUMNS}}


def _trl(paths, output_dir: str, explicit_ref: bool) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOTrainer

    grads: dict = {}
    ref = AutoModelForCausalLM.from_pretrained(paths[1], dtype=torch.float32) if explicit_ref else None
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(paths[0], dtype=torch.float32), ref_model=ref,
                         args=_config(output_dir), train_dataset=_text_pairs(8),
                         processing_class=AutoTokenizer.from_pretrained(paths[2]), callbacks=[_grab_callback(grads)])
    trainer.train()
    return _result(trainer, grads)


def _sharded(paths, output_dir: str, explicit_ref: bool, ulysses: int, ring: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_longctx import LongDPOTrainer, patch

    mesh = worker_mesh(ulysses, ring)
    tok = AutoTokenizer.from_pretrained(paths[2])
    grads: dict = {}
    ref = AutoModelForCausalLM.from_pretrained(paths[1], dtype=torch.float32) if explicit_ref else None
    model = patch(AutoModelForCausalLM.from_pretrained(paths[0], dtype=torch.float32), mesh)
    trainer = LongDPOTrainer(model=model, ref_model=ref, args=_config(output_dir), mesh=mesh, max_tokens=64,
                             train_dataset=_id_pairs(tok, _text_pairs(8)), processing_class=tok,
                             callbacks=[_grab_callback(grads)], tokens_per_step=4096)
    held = trainer.ref_model
    trainer.train()
    out = _result(trainer, grads)
    out["held"], out["microbatches"] = held, len(trainer.last_plan.plan[mesh.dp_rank])
    return out


@pytest.mark.parametrize("ulysses,ring,explicit_ref", [(2, 2, True), (2, 1, False)])
def test_precompute_matches_trl(pools, paths, tmp_path, ulysses, ring, explicit_ref):
    pytest.importorskip("trl")
    want = _trl(paths, str(tmp_path / "trl"), explicit_ref)
    if explicit_ref:
        assert 0 < want["metrics"]["rewards/accuracies"] < 1 and want["metrics"]["rewards/margins"] != 0
    out = pools.get(4).run(_sharded, paths, str(tmp_path / "sp"), explicit_ref, ulysses, ring, timeout=300)
    for rank, got in enumerate(out):
        where = f"rank {rank} U{ulysses}xR{ring} ref={'explicit' if explicit_ref else 'default'}"
        assert got["held"] is None, f"{where}: the reference is still held after the pass"
        assert got["microbatches"] >= 2, f"{where}: one micro-batch only, accumulation untested"
        for c in COLUMNS:
            torch.testing.assert_close(got["columns"][c], want["columns"][c], rtol=1e-5, atol=0, msg=f"{where}: {c}")
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), f"{where}: loss {got['loss']} vs {want['loss']}"
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-4 * want["grad_norm"], f"{where}: grad_norm"
        for k, v in want["metrics"].items():
            assert abs(got["metrics"][k] - v) <= 1e-5 * (1 + abs(v)), f"{where}: {k} {got['metrics'][k]} vs {v}"
        assert set(got["grads"]) == set(want["grads"]), f"{where}: gradient sets differ"
        for n, g in want["grads"].items():
            err = (got["grads"][n] - g).abs().max() / g.abs().max().clamp_min(1e-30)
            assert err <= 1e-4, f"{where}: gradient of {n} off by {err:.2e} (relative to its max)"


def _one_process(paths, tmp_path, train_dataset, ref: bool = True, **kw):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_longctx import LongDPOTrainer, init_sequence_parallel, patch

    mesh = init_sequence_parallel()
    model = patch(AutoModelForCausalLM.from_pretrained(paths[0], dtype=torch.float32), mesh)
    reference = AutoModelForCausalLM.from_pretrained(paths[1], dtype=torch.float32) if ref else None
    return LongDPOTrainer(model=model, ref_model=reference, args=_config(str(tmp_path)), train_dataset=train_dataset,
                          processing_class=AutoTokenizer.from_pretrained(paths[2]), mesh=mesh, max_tokens=64,
                          tokens_per_step=4096, **kw)


def _loss(trainer) -> float:
    trainer.train()
    return next(h["loss"] for h in trainer.state.log_history if "loss" in h)


def test_stored_columns_are_used_as_is(paths, tmp_path):
    """A dataset that already carries TRL's two columns is not scored again: its values train
    (zeros instead of the reference's sums give another loss)."""
    from transformers import AutoTokenizer

    pairs = _id_pairs(AutoTokenizer.from_pretrained(paths[2]), _text_pairs(8))
    scored = _one_process(paths, tmp_path / "a", pairs)
    assert all(v < 0 for v in scored.train_dataset["ref_chosen_logps"])
    given = scored.train_dataset.select_columns(["prompt_ids", "chosen_ids", "rejected_ids", *COLUMNS])
    again = _one_process(paths, tmp_path / "b", given)
    assert again.train_dataset["ref_chosen_logps"] == given["ref_chosen_logps"]
    zeros = given.remove_columns(list(COLUMNS)).add_column(COLUMNS[0], [0.0] * 8).add_column(COLUMNS[1], [0.0] * 8)
    assert abs(_loss(again) - _loss(_one_process(paths, tmp_path / "c", zeros))) > 1e-3


def test_changing_rows_are_refused(paths, tmp_path):
    """A format transform is refused at construction; a row whose ids differ from the scored ones
    (the fingerprint columns travel with it) is refused before the step; a dataset given to
    evaluate() after the reference was released is refused; precompute_ref_batch_size too."""
    from transformers import AutoTokenizer

    from hf_longctx.errors import NotSupported

    pairs = _id_pairs(AutoTokenizer.from_pretrained(paths[2]), _text_pairs(8))
    with pytest.raises(NotSupported, match="format transform(.|\n)*Do instead: apply it once"):
        _one_process(paths, tmp_path / "a", pairs.with_transform(lambda b: b))
    trainer = _one_process(paths, tmp_path / "b", pairs)
    trainer.train_dataset = trainer.train_dataset.map(lambda r: {"chosen_ids": r["chosen_ids"][::-1]})
    with pytest.raises(ValueError, match="train_dataset: its stored(.|\n)*token ids that differ(.|\n)*pair 0(.|\n)*"
                                         "Do instead: drop the stale columns"):
        trainer.train()
    with pytest.raises(NotSupported, match="no longer held"):
        trainer.evaluate(eval_dataset=pairs)
    with pytest.raises(NotSupported, match="precompute_ref_batch_size=4"):
        args = _config(str(tmp_path / "c"))
        args.precompute_ref_batch_size = 4
        from hf_longctx.training.refusals.dpo import check_dpo_config
        check_dpo_config(args)
