"""`LongDPOTrainer` on 4 gloo ranks vs TRL's own `DPOTrainer` in one process.

The reference is the REAL, unpatched `trl.DPOTrainer` on the same saved tiny Llama (loaded
with `from_pretrained`), the same 8 pairs in one batch, the same `DPOConfig` (beta, loss_type,
fp32, plain SGD, constant learning rate, no clipping in effect). One optimizer step
(`max_steps=1`) of `LongDPOTrainer.train()` on U2×R2 and dp2×U2 must give: the logged loss
(1e-5 relative), grad_norm (1e-4 relative), every parameter gradient as the optimizer sees it
(captured in `on_pre_optimizer_step`, full tensors of the FSDP2 shards; 1e-4 relative to the
tensor's max), and TRL's logged rewards/chosen, rewards/rejected, rewards/margins,
rewards/accuracies, logps/chosen, logps/rejected, entropy, logits/chosen, logits/rejected,
mean_token_accuracy (1e-5 absolute + relative) and num_tokens.
With TRL's default reference (ref_model=None: the initial model) the rewards are all zero at
the first step, so two cases pass an explicit reference (another saved model) to make them
non-trivial. Datasets: token-id prompt/chosen/rejected lists (one form LongDPOTrainer reads) and,
in one case, TRL's text form (tokenized by TRL itself); the reference always gets the text.
One pair on dp2×U2 leaves a DP rank an empty plan slot (its forwards still run). Ulysses 4 with
FPDT chunks 2 under memory="max" (row-chunked checkpointed layers, chunked LM head for policy
and reference) gives the same figures. Two steps
(dp2×U2, default reference, so step 2 has non-zero rewards) equal TRL's, and resuming from the
step-1 checkpoint trains one step that equals the uninterrupted step 2. `evaluate()` on U2×R2
equals TRL's one-batch evaluation (eval_loss and eval metrics). Refusals: each refused
setting raises `NotSupported` at construction with a "Do instead" line. `DPOConfig(
parallelism_config=...)` without mesh= gives the trainer its mesh (one process).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.pool import worker_mesh
from tests.helpers.trainer_cases import trainer_env
from tests.helpers.dpo_cases import BETA, _grab_callback, _id_pairs, _text_pairs, paths  # noqa: F401  (paths: a fixture)

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected", "num_tokens", "entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy")


def _config(output_dir: str, loss_type: str):
    from trl import DPOConfig

    trainer_env()
    return DPOConfig(output_dir=output_dir, max_steps=1, learning_rate=1e-2, optim="sgd", lr_scheduler_type="constant",
                     max_grad_norm=1e9, logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True,
                     save_strategy="no", seed=0, bf16=False, max_length=None, beta=BETA, loss_type=loss_type)


def _result(trainer, grads: dict) -> dict:
    log = next(h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h)
    return {"loss": log["loss"], "grad_norm": log["grad_norm"], "metrics": {k: log[k] for k in METRICS},
            "grads": {n: g.double() for n, g in grads.items()}}


def _reference(paths, output_dir: str, loss_type: str, explicit_ref: bool, n_pairs: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOTrainer

    model_path, ref_path, tok_path = paths
    grads: dict = {}
    ref = AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32) if explicit_ref else None
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), ref_model=ref,
                         args=_config(output_dir, loss_type), train_dataset=_text_pairs(n_pairs),
                         processing_class=AutoTokenizer.from_pretrained(tok_path), callbacks=[_grab_callback(grads)])
    trainer.train()
    return _result(trainer, grads)


def _sharded(paths, output_dir: str, loss_type: str, explicit_ref: bool, ulysses: int, ring: int, data: str,
             n_pairs: int, fpdt: int = 1, memory: str | None = None) -> dict:
    from torch.distributed.tensor import DTensor

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_longctx import LongDPOTrainer, patch

    model_path, ref_path, tok_path = paths
    mesh = worker_mesh(ulysses, ring, fpdt)
    tok = AutoTokenizer.from_pretrained(tok_path)
    pairs = _text_pairs(n_pairs) if data == "text" else _id_pairs(tok, _text_pairs(n_pairs))
    grads: dict = {}
    ref = AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32) if explicit_ref else None
    model = patch(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), mesh, memory=memory)
    trainer = LongDPOTrainer(model=model, ref_model=ref, args=_config(output_dir, loss_type), train_dataset=pairs,
                             processing_class=tok, callbacks=[_grab_callback(grads)], mesh=mesh, max_tokens=64,
                             tokens_per_step=4096)
    trainer.train()
    out = _result(trainer, grads)
    mine = trainer.last_plan.plan[mesh.dp_rank]
    out["microbatches"], out["empty"] = len(mine), sum(1 for mb in mine if not mb)
    out["ref_sharded"] = [n for n, p in trainer.ref_model.named_parameters() if not isinstance(p, DTensor)]
    return out


def _close(got: float, want: float, tol: float) -> bool:
    return abs(got - want) <= tol * (1.0 + abs(want))  # relative above 1, absolute below (rewards: β·(differences of ~50))


CASES = [  # (ulysses, ring, loss_type, explicit reference, dataset form, pairs: 1 leaves a DP rank an empty slot)
    (2, 2, "sigmoid", False, "ids", 8),
    (2, 1, "sigmoid", True, "ids", 8),
    (2, 2, "ipo", True, "text", 8),
    (2, 1, "hinge", True, "ids", 1),
]


@pytest.mark.parametrize("ulysses,ring,loss_type,explicit_ref,data,n_pairs", CASES)
def test_dpo_trainer_matches_trl(pools, paths, tmp_path, ulysses, ring, loss_type, explicit_ref, data, n_pairs):
    _compare(pools, paths, tmp_path, ulysses, ring, loss_type, explicit_ref, data, n_pairs)


def test_dpo_trainer_at_length_matches_trl(pools, paths, tmp_path):
    """Ulysses 4 with FPDT chunks 2 under memory="max" (checkpointed row-chunked layers, chunked
    MLP and LM head for the policy; the reference patched alike, its head chunked): the same
    figures as the cases above against TRL (explicit reference: non-zero margins)."""
    _compare(pools, paths, tmp_path, 4, 1, "sigmoid", True, "ids", 8, fpdt=2, memory="max")


def _compare(pools, paths, tmp_path, ulysses, ring, loss_type, explicit_ref, data, n_pairs, fpdt=1, memory=None):
    pytest.importorskip("trl")
    want = _reference(paths, str(tmp_path / "ref"), loss_type, explicit_ref, n_pairs)
    out = pools.get(4).run(_sharded, paths, str(tmp_path / "sp"), loss_type, explicit_ref, ulysses, ring, data, n_pairs,
                           fpdt, memory, timeout=300)
    if explicit_ref and n_pairs > 1:
        assert 0 < want["metrics"]["rewards/accuracies"] < 1 and want["metrics"]["rewards/margins"] != 0
    if n_pairs == 1:
        assert any(got["empty"] for got in out), "no DP rank had an empty slot"
    worst = {"loss": 0.0, "grad_norm": 0.0, "metrics": 0.0, "grads": 0.0}
    for rank, got in enumerate(out):
        where = f"rank {rank} U{ulysses}xR{ring} {loss_type}"
        assert not got["ref_sharded"], f"{where}: reference parameters not FSDP-sharded: {got['ref_sharded'][:4]}"
        assert got["microbatches"] >= 2 or n_pairs == 1, f"{where}: one micro-batch only, accumulation untested"
        worst["loss"] = max(worst["loss"], abs(got["loss"] - want["loss"]) / abs(want["loss"]))
        worst["grad_norm"] = max(worst["grad_norm"], abs(got["grad_norm"] - want["grad_norm"]) / want["grad_norm"])
        worst["metrics"] = max([worst["metrics"]] + [abs(got["metrics"][k] - v) for k, v in want["metrics"].items()])
        worst["logits_rel"] = max([worst.get("logits_rel", 0.0)] + [abs(got["metrics"][k] - want["metrics"][k]) / abs(want["metrics"][k])
                                                                     for k in ("logits/chosen", "logits/rejected")])
        worst["grads"] = max([worst["grads"]] + [((got["grads"][n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
                                                 for n, g in want["grads"].items() if n in got["grads"]])
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), f"{where}: loss {got['loss']} vs {want['loss']}"
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-4 * want["grad_norm"], f"{where}: grad_norm"
        for k, v in want["metrics"].items():
            assert _close(got["metrics"][k], v, 1e-5), f"{where}: {k} {got['metrics'][k]} vs {v}"
            if k.startswith("logits/"):  # ~1e-3: relative too
                assert abs(got["metrics"][k] - v) <= 1e-5 * abs(v), f"{where}: {k} {got['metrics'][k]} vs {v}"
        assert set(got["grads"]) == set(want["grads"]), f"{where}: gradient sets differ"
        for n, g in want["grads"].items():
            err = (got["grads"][n] - g).abs().max() / g.abs().max().clamp_min(1e-30)
            assert err <= 1e-4, f"{where}: gradient of {n} off by {err:.2e} (relative to its max)"
    print(f"U{ulysses}xR{ring} {loss_type} ref={'explicit' if explicit_ref else 'default'} {data}: worst {worst}; "
          f"reference metrics {want['metrics']}")


def _refusal_case(kind: str, paths):
    """(DPOConfig fields, LongDPOTrainer keyword arguments) of one refused setting."""
    from datasets import Dataset

    if kind == "eval_dataset":
        return {}, {"eval_dataset": Dataset.from_dict({"text": ["w1 w2"]})}
    if kind == "dataset":
        return {}, {"train_dataset": Dataset.from_dict({"input_ids": [[1, 2, 3]]})}
    if kind == "peft_config":
        return {}, {"peft_config": object()}
    return {kind: {"precompute_ref_batch_size": 4, "loss_type": "robust", "max_length": 1024,
                   "use_weighting": True}[kind]}, {}


@pytest.mark.parametrize("kind,match", [
    ("precompute_ref_batch_size", "precompute_ref_batch_size"), ("loss_type", "loss_type"), ("max_length", "max_length"),
    ("use_weighting", "use_weighting"), ("eval_dataset", "eval_dataset columns"), ("dataset", "not preference pairs"),
    ("peft_config", "peft_config"),
])
def test_dpo_trainer_refusals(paths, tmp_path, kind, match):
    """Refused at construction, before any collective, with the cause and a "Do instead" line."""
    pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig

    from hf_longctx import LongDPOTrainer, init_sequence_parallel, patch
    from hf_longctx.errors import NotSupported

    trainer_env()
    cfg, kw = _refusal_case(kind, paths)
    mesh = init_sequence_parallel()
    model = patch(AutoModelForCausalLM.from_pretrained(paths[0], dtype=torch.float32), mesh)
    args = DPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], **{"max_length": None, **cfg})
    kw = {"train_dataset": _text_pairs(), **kw}
    with pytest.raises(NotSupported, match=match) as err:
        LongDPOTrainer(model=model, args=args, mesh=mesh, max_tokens=48, tokens_per_step=4096,
                       processing_class=AutoTokenizer.from_pretrained(paths[2]), **kw)
    assert "do instead" in str(err.value).lower()


def test_dpo_trainer_takes_the_mesh_of_a_parallelism_config(paths, tmp_path):
    """`DPOConfig(parallelism_config=...)` without mesh=: the trainer builds the mesh it maps to (one
    process: the mesh of 1), patches the policy and trains; the Accelerator never sees the config."""
    from accelerate import ParallelismConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_longctx import LongDPOTrainer, is_patched

    args = _config(str(tmp_path), "sigmoid")
    args.parallelism_config = ParallelismConfig()
    model = AutoModelForCausalLM.from_pretrained(paths[0], dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(paths[2])
    trainer = LongDPOTrainer(model=model, args=args, train_dataset=_id_pairs(tok, _text_pairs()), processing_class=tok,
                             max_tokens=64, tokens_per_step=4096)
    assert is_patched(model) and trainer.mesh.world_size == 1
    assert trainer.accelerator.parallelism_config is None and args.parallelism_config is not None
    trainer.train()
    assert [h["loss"] for h in trainer.state.log_history if "loss" in h]


STEP_KEYS = ("loss", "grad_norm", "rewards/margins", "rewards/accuracies", "logps/chosen")


def _steps(trainer) -> list[tuple]:
    return [tuple(h[k] for k in STEP_KEYS) for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]


def _two_steps_reference(paths, output_dir: str) -> list[tuple]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOTrainer

    args = _config(output_dir, "sigmoid")
    args.max_steps = 2
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(paths[0], dtype=torch.float32), args=args,
                         train_dataset=_text_pairs(), processing_class=AutoTokenizer.from_pretrained(paths[2]))
    trainer.train()
    return _steps(trainer)


def _two_steps_sharded(paths, output_dir: str, resume: bool) -> tuple[list[tuple], int]:
    """(per-step logs, optimizer steps this run trained)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from hf_longctx import LongDPOTrainer, patch

    mesh = worker_mesh(2, 1)
    tok = AutoTokenizer.from_pretrained(paths[2])
    args = _config(output_dir, "sigmoid")
    args.max_steps, args.save_strategy, args.save_steps = 2, "steps", 1
    model = patch(AutoModelForCausalLM.from_pretrained(paths[0], dtype=torch.float32), mesh)
    trained = []

    class Count(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            trained.append(state.global_step)

    trainer = LongDPOTrainer(model=model, args=args, train_dataset=_id_pairs(tok, _text_pairs()), processing_class=tok,
                             callbacks=[Count()], mesh=mesh, max_tokens=64, tokens_per_step=4096)
    trainer.train(resume_from_checkpoint=f"{output_dir}/checkpoint-1" if resume else None)
    return _steps(trainer), len(trained)


def test_dpo_trainer_second_step_and_resume(pools, paths, tmp_path):
    """Two SGD steps with TRL's default reference (rewards non-zero at step 2) equal TRL's, on
    dp2×U2; resuming from the step-1 checkpoint gives the same step 2."""
    pytest.importorskip("trl")
    want = _two_steps_reference(paths, str(tmp_path / "ref"))
    assert len(want) == 2 and want[1][2] != 0, want
    pool = pools.get(4)
    full = pool.run(_two_steps_sharded, paths, str(tmp_path / "sp"), False, timeout=300)
    resumed = pool.run(_two_steps_sharded, paths, str(tmp_path / "sp"), True, timeout=300)
    for rank, ((got, n_full), (again, n_resumed)) in enumerate(zip(full, resumed)):
        assert (n_full, n_resumed) == (2, 1), f"rank {rank}: trained {n_full} then {n_resumed} step(s)"
        assert len(got) == 2 and len(again) == 2, f"rank {rank}: {got} / {again}"  # resumed: step 1 from trainer_state
        for step, (g, w) in enumerate(zip(got, want)):
            for k, a, b in zip(STEP_KEYS, g, w):
                assert _close(a, b, 1e-5), f"rank {rank} step {step + 1}: {k} {a} vs TRL {b}"
        for k, a, b in zip(STEP_KEYS, again[1], got[1]):
            assert _close(a, b, 1e-6), f"rank {rank} resumed step 2: {k} {a} vs uninterrupted {b}"


EVAL_KEYS = ("eval_loss", "eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/margins", "eval_rewards/accuracies",
             "eval_logps/chosen", "eval_logps/rejected", "eval_entropy", "eval_mean_token_accuracy")


def _evaluate(paths, output_dir: str, sharded: bool) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOTrainer

    from hf_longctx import LongDPOTrainer, patch

    tok = AutoTokenizer.from_pretrained(paths[2])
    model = AutoModelForCausalLM.from_pretrained(paths[0], dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(paths[1], dtype=torch.float32)
    common = dict(ref_model=ref, args=_config(output_dir, "sigmoid"), processing_class=tok)
    if sharded:
        mesh = worker_mesh(2, 2)
        trainer = LongDPOTrainer(model=patch(model, mesh), train_dataset=_id_pairs(tok, _text_pairs()),
                                 eval_dataset=_id_pairs(tok, _text_pairs(8, seed=1)), mesh=mesh, max_tokens=64,
                                 tokens_per_step=4096, **common)
    else:
        trainer = DPOTrainer(model=model, train_dataset=_text_pairs(), eval_dataset=_text_pairs(8, seed=1), **common)
    metrics = trainer.evaluate()
    return {k: metrics[k] for k in EVAL_KEYS}


def test_dpo_trainer_evaluate_matches_trl(pools, paths, tmp_path):
    """evaluate() on U2×R2 (8 eval pairs, explicit reference): eval_loss and TRL's eval metrics
    equal TRL's one-batch evaluation (TRL averages per-batch means; one batch makes that the
    global mean our evaluation computes)."""
    pytest.importorskip("trl")
    want = _evaluate(paths, str(tmp_path / "ref"), False)
    assert want["eval_rewards/margins"] != 0
    for rank, got in enumerate(pools.get(4).run(_evaluate, paths, str(tmp_path / "sp"), True, timeout=300)):
        for k, v in want.items():
            assert _close(got[k], v, 1e-5), f"rank {rank}: {k} {got[k]} vs TRL {v}"
