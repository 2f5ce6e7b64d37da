"""`LongGRPOTrainer` (training/grpo/trainer.py) on 4 gloo ranks equals the REAL single-process
TRL `GRPOTrainer` over one optimizer step.

Generation is made deterministic by overriding TRL's generation hook `_generate_single_turn`
identically in both trainers (`FixedCompletions`): row k of the step's global generation batch
gets `fixed_completion(prompt, k)` (1..10 tokens, most ending with EOS), k = process_index x rows
per process + local index. Everything else is TRL's own: the dataset of text prompts and its
RepeatSampler, tokenization, two reward functions, group advantages, metrics, SGD.

Batch semantics: TRL's sampler draws `generation_batch_size = per_device_train_batch_size x
num_processes` rows per step (each prompt repeated num_generations times) and Accelerate gives
process i the i-th block of `per_device_train_batch_size` rows. The 4 ranks run with
per_device_train_batch_size=3 (12 rows, 6 prompts x 2 generations, a prompt's generations
straddle processes); the reference runs in one process with per_device_train_batch_size=12:
the same seed gives the same 12 rows, and its batch is the union of what the 4 ranks train on
(an SP group trains on the union of its ranks' rows). gradient_accumulation_steps=1 (TRL's
default steps_per_generation follows it).

Reference model (beta > 0): TRL builds it from the policy's `config._name_or_path`; both
trainers point that at a second saved checkpoint (different weights), so the KL term and its
gradient are non-zero (a reference equal to the policy gives KL = 0 and no KL gradient).

Checked for loss_type grpo, dr_grpo and dapo (beta = 0) and dapo with beta = 0.04, on
U2xR2 (one SP group of 4) and dp2xU2 (two DP groups), and dapo with beta = 0.04 on Ulysses 4
with FPDT chunks 2 under memory="max" (chunked LM head for policy and reference): the step loss (1e-5 relative, plus 1e-8
absolute: on-policy "grpo" has loss -mean(advantages) = 0 at the first step), grad_norm
(1e-4 relative), the parameter updates of one plain-SGD step (lr 1, max_grad_norm 1: the clipped
gradient; every parameter, 1e-4 relative) and every metric TRL logs (reward, reward_std,
rewards/<f>/mean|std, frac_reward_zero_std, completions/*, num_tokens, entropy, kl, clip ratios,
learning_rate, epoch; 1e-5); step_time and tokens_per_s are wall-clock and skipped. On-policy (num_iterations=1)
the ratio is 1, so the clip ratios are 0 on both sides (clipping itself: test_grpo_step.py).

Also: TRL's real sampling through LongGRPOTrainer on 2 ranks with ragged completion lengths
(no hang, same logs on both ranks, save_model writes the trained weights); bf16 weights within
the project's 2x rule against the float64 single-process GRPOTrainer; every construction
refusal raises NotSupported with a "Do instead"; and LongGRPOTrainer on a one-process mesh equals
GRPOTrainer as well (the packed-row path without FSDP).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.families import rel
from tests.helpers.pool import worker_mesh
from tests.helpers.trainer_cases import trainer_env
from tests.helpers.grpo_cases import (  # noqa: F401  (paths: a fixture)
    GENERATIONS, GRAD_TOL, LOSS_TOL, METRIC_TOL, ROWS, WORLD, FixedCompletions, _run, assert_refused, make_prompts, paths,
    reward_length, reward_tokens,
)

CASES = [("grpo", 0.0), ("dr_grpo", 0.0), ("dapo", 0.0), ("dapo", 0.04)]


@pytest.fixture(scope="module")
def references(paths, tmp_path_factory):
    pytest.importorskip("trl")
    out = tmp_path_factory.mktemp("grpo_ref")
    return {case: _run(*paths, str(out / f"{case[0]}-{case[1]}"), *case, None) for case in CASES}


def _sp_cases(model_path, ref_path, tok_path, out_dir, ulysses, ring):
    return [_run(model_path, ref_path, tok_path, f"{out_dir}/{t}-{b}", t, b, (ulysses, ring)) for t, b in CASES]


@pytest.mark.parametrize("ulysses,ring", [(2, 2), (2, 1)], ids=["U2xR2", "dp2xU2"])
def test_grpo_trainer_matches_single_process_trl(pools, paths, references, tmp_path, ulysses, ring):
    results = pools.get(WORLD).run(_sp_cases, *paths, str(tmp_path), ulysses, ring, timeout=600)
    for case, ref in references.items():
        assert ref["log"]["reward_std"] > 0 and ref["log"]["grad_norm"] > 0.1, f"{case}: a vacuous reference {ref['log']}"
        if case[1]:
            assert ref["log"]["kl"] > 1e-4, f"{case}: the reference must differ from the policy"
        assert max(u.abs().max().item() for u in ref["updates"].values()) > 1e-4, f"{case}: no update"
    for rank, per_case in enumerate(results):
        for case, got in zip(CASES, per_case):
            ref = references[case]
            where = f"rank {rank} ulysses={ulysses} ring={ring} dp={WORLD // (ulysses * ring)} {case}"
            assert set(got["log"]) == set(ref["log"]), f"{where}: logged keys {sorted(got['log'])} vs {sorted(ref['log'])}"
            # on-policy "grpo" at the first step: the loss is -mean(advantages) = 0 (groups are centred), so an absolute floor
            assert abs(got["log"]["loss"] - ref["log"]["loss"]) <= LOSS_TOL * abs(ref["log"]["loss"]) + 1e-8, \
                f"{where}: loss {got['log']['loss']} vs {ref['log']['loss']}"
            assert got["log"]["grad_norm"] == pytest.approx(ref["log"]["grad_norm"], rel=GRAD_TOL), where
            for name, want in ref["log"].items():
                assert got["log"][name] == pytest.approx(want, rel=METRIC_TOL, abs=METRIC_TOL), \
                    f"{where}: {name} {got['log'][name]} vs {want}"
            assert got["ref_sharded"] == bool(case[1]), f"{where}: the reference must be FSDP2-sharded (beta > 0)"
            assert set(got["updates"]) == set(ref["updates"]), where
            worst = max((rel(got["updates"][k], ref["updates"][k]), k) for k in ref["updates"])
            assert worst[0] <= GRAD_TOL, f"{where}: parameter update rel err {worst}"


def _at_length(model_path, ref_path, tok_path, out_dir):
    return _run(model_path, ref_path, tok_path, out_dir, "dapo", 0.04, (4, 1), fpdt=2, memory="max")


def test_grpo_trainer_at_length_matches_single_process_trl(pools, paths, references, tmp_path):
    """Ulysses 4 with FPDT chunks 2 under memory="max" (the policy's layers row-chunked and
    checkpointed, MLP and LM head chunked; the reference patched alike), dapo with the KL term:
    the logged loss, grad_norm, every metric and the SGD update equal the single-process TRL step."""
    ref = references[("dapo", 0.04)]
    for rank, got in enumerate(pools.get(WORLD).run(_at_length, *paths, str(tmp_path), timeout=600)):
        assert set(got["log"]) == set(ref["log"]) and got["ref_sharded"], f"rank {rank}: {sorted(got['log'])}"
        for name, want in ref["log"].items():
            tol = GRAD_TOL if name == "grad_norm" else METRIC_TOL
            assert got["log"][name] == pytest.approx(want, rel=tol, abs=tol), f"rank {rank}: {name} {got['log'][name]} vs {want}"
        worst = max((rel(got["updates"][k], ref["updates"][k]), k) for k in ref["updates"])
        assert worst[0] <= GRAD_TOL, f"rank {rank}: parameter update rel err {worst}"


def _generate_for_real(model_path: str, tok_path: str, out_dir: str) -> dict:
    """Two steps of LongGRPOTrainer with TRL's own sampling (no injection) on this rank."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from hf_longctx import is_patched, patch
    from hf_longctx.training.grpo.trainer import LongGRPOTrainer

    trainer_env()
    lengths: list[list[int]] = []

    class Recording(LongGRPOTrainer):
        def _generate_single_turn(self, *args, **kwargs):
            completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
            lengths.append([len(c) for c in completion_ids])
            return completion_ids, logprobs

    cfg = GRPOConfig(output_dir=out_dir, max_steps=2, per_device_train_batch_size=2, num_generations=2,
                     max_completion_length=12, temperature=1.0, loss_type="dapo", optim="sgd", learning_rate=0.1,
                     logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no", seed=3,
                     bf16=False, gradient_checkpointing=False)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.generation_config.eos_token_id = list(range(1, 41))  # a third of the vocabulary stops: ragged lengths
    mesh = worker_mesh(2, 1)
    trainer = Recording(model=patch(model, mesh), mesh=mesh, reward_funcs=[reward_length], args=cfg,
                        train_dataset=make_prompts(), processing_class=AutoTokenizer.from_pretrained(tok_path))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    trainer.save_model(f"{out_dir}/final")  # a collective: the consolidated policy, loadable unpatched
    import torch.distributed as dist

    dist.barrier()
    saved = AutoModelForCausalLM.from_pretrained(f"{out_dir}/final", dtype=torch.float32)
    trained = {k: p.full_tensor() for k, p in trainer.model.named_parameters()}
    saved_diff = max((saved.get_parameter(k) - v).abs().max().item() for k, v in trained.items())
    return {"lengths": lengths, "loss": [h["loss"] for h in logs], "patched": is_patched(trainer.model),
            "mean_length": [h["completions/mean_length"] for h in logs], "saved_diff": saved_diff}


def test_grpo_trainer_one_process_matches_trl(paths, references, tmp_path):
    """LongGRPOTrainer on a mesh of one process (no FSDP; the reference patched, not sharded)
    equals TRL's GRPOTrainer too: the packed-row path alone, dapo with beta 0.04."""
    case = ("dapo", 0.04)
    got, ref = _run(*paths, str(tmp_path), *case, (1, 1)), references[case]
    assert set(got["log"]) == set(ref["log"]) and not got["ref_sharded"]
    for name, want in ref["log"].items():
        assert got["log"][name] == pytest.approx(want, rel=METRIC_TOL, abs=METRIC_TOL), f"{name} {got['log'][name]} vs {want}"
    worst = max((rel(got["updates"][k], ref["updates"][k]), k) for k in ref["updates"])
    assert worst[0] <= GRAD_TOL, f"parameter update rel err {worst}"


def test_grpo_trainer_real_generation_ragged_lengths(pools, paths, tmp_path):
    """TRL's own generation path through LongGRPOTrainer on 2 ranks (Ulysses 2, FSDP2): ranks decode
    different numbers of tokens in the same step and the step still finishes (no hang in the
    FSDP2 all-gathers); both ranks log the same global loss and completion lengths, the
    model is patched again after generation, and `save_model` writes the trained weights."""
    model_path, _, tok_path = paths
    out = pools.get(2).run(_generate_for_real, model_path, tok_path, str(tmp_path), timeout=300)
    assert all(r["patched"] for r in out) and all(len(r["loss"]) == 2 for r in out), out
    assert out[0]["loss"] == out[1]["loss"] and out[0]["mean_length"] == out[1]["mean_length"], out
    per_step_max = [[max(step) for step in r["lengths"]] for r in out]  # [rank][step]: tokens decoded by that rank
    assert any(a != b for a, b in zip(*per_step_max)), f"ranks decoded the same lengths in every step: {per_step_max}"
    assert all(1 <= n <= 12 for r in out for step in r["lengths"] for n in step), out
    assert all(r["saved_diff"] == 0.0 for r in out), [r["saved_diff"] for r in out]  # save_model: the trained weights


@pytest.mark.parametrize("kw,match", [
    (dict(gradient_accumulation_steps=2), "gradient_accumulation_steps=2"),
    (dict(num_iterations=2), "num_iterations=2"),
    (dict(loss_type="bnpo"), "loss_type='bnpo'"),
    (dict(use_vllm=True), "use_vllm=True"),
    (dict(mask_truncated_completions=True), "mask_truncated_completions=True"),
    (dict(eval_strategy="steps", eval_steps=1), "evaluation"),
    (dict(top_entropy_quantile=0.5), "top_entropy_quantile=0.5"),
    (dict(save_strategy="steps", save_only_model=True), "save_only_model=True"),
    (dict(ignore_data_skip=True), "ignore_data_skip=True"),
    (dict(save_strategy="best", metric_for_best_model="reward"), "save_strategy='best'"),
    (dict(torch_compile=True), r"torch_compile=True: each rollout step takes the SP patch off(.|\n)*LongContextTrainer and LongDPOTrainer "
                               "honour torch_compile=True"),
    (dict(neftune_noise_alpha=5.0), "neftune_noise_alpha=5.0"),
    (dict(loss_type="bnpo", num_iterations=2), r"loss_type='bnpo'(.|\n)*num_iterations=2"),  # all listed at once
], ids=["grad_accum", "num_iterations", "bnpo", "vllm", "mask_truncated", "eval", "entropy_quantile", "model_only_checkpoints",
        "ignore_data_skip", "best_checkpoint",
        "compile", "neftune", "together"])
def test_grpo_trainer_refusals(paths, tmp_path, kw, match):
    """Every refused setting raises NotSupported at construction, naming the value and a "Do instead"."""
    pytest.importorskip("trl")
    assert_refused(paths, tmp_path, "GRPO", kw, match)


def test_grpo_trainer_needs_patched_model(paths, tmp_path):
    pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig

    from hf_longctx import init_sequence_parallel
    from hf_longctx.training.grpo.trainer import LongGRPOTrainer

    cfg = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, report_to=[],
                     use_cpu=True, bf16=False, gradient_checkpointing=False, save_strategy="no")
    with pytest.raises(ValueError, match="not patched"):
        LongGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(paths[0]), mesh=init_sequence_parallel(),
                        reward_funcs=[reward_length], args=cfg, train_dataset=make_prompts())


def _rollout_trainer(paths, tmp_path, name: str):
    """A `Long<name>Trainer` on a world-1 mesh (beta 0.04: a frozen reference) over the tiny Llama."""
    trl = pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_longctx

    model_path, ref_path, tok_path = paths
    cfg = getattr(trl, f"{name}Config")(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                                        report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False,
                                        save_strategy="no", beta=0.04)
    mesh = hf_longctx.init_sequence_parallel()
    return getattr(hf_longctx, f"Long{name}Trainer")(
        model=hf_longctx.patch(AutoModelForCausalLM.from_pretrained(model_path), mesh), mesh=mesh,
        reward_funcs=[reward_length], args=cfg, train_dataset=make_prompts(),
        processing_class=AutoTokenizer.from_pretrained(tok_path))


@pytest.mark.parametrize("name", ["GRPO", "RLOO"])
def test_evaluate_and_predict_are_refused_by_name(paths, tmp_path, name):
    """Evaluation rollouts are not wired to the SP step: the constructor refuses eval_strategy /
    eval_dataset, and a direct evaluate() / predict() raises NotSupported naming the trainer."""
    import hf_longctx

    trainer = _rollout_trainer(paths, tmp_path, name)
    with pytest.raises(hf_longctx.NotSupported, match=rf"Long{name}Trainer.evaluate\(\): evaluation rollouts"):
        trainer.evaluate(make_prompts())
    with pytest.raises(hf_longctx.NotSupported, match=rf"Long{name}Trainer.predict\(\)"):
        trainer.predict(make_prompts())


@pytest.mark.parametrize("name", ["GRPO", "RLOO"])
def test_resume_checks_the_reference_source_before_reading_the_shards(paths, tmp_path, name, monkeypatch):
    """The rollout trainers' own checkpoint state goes through the base's load: a checkpoint
    without the reference's source is refused before the step's shards are read."""
    from hf_longctx.training.base import trainer as base

    trainer = _rollout_trainer(paths, tmp_path, name)
    read = []
    monkeypatch.setattr(base, "load_step_state", lambda *a, **k: read.append(a))
    (tmp_path / "checkpoint-1").mkdir()
    with pytest.raises(ValueError, match="not written by a LongGRPOTrainer or LongRLOOTrainer"):
        trainer._load_optimizer_and_scheduler(str(tmp_path / "checkpoint-1"))
    assert not read


class GradSnapshot:
    """Keeps the summed gradient of the step (before clipping) as float64 full tensors."""

    def _clip_grad_norm(self, model):
        self.grads = {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().double().clone()
                      for k, p in model.named_parameters() if p.grad is not None}
        return super()._clip_grad_norm(model)


def _run_dtype(model_path: str, ref_path: str, tok_path: str, out_dir: str, dtype: torch.dtype,
               mesh_shape: tuple[int, int] | None) -> dict:
    """One dapo step with beta 0.04 with the weights in `dtype`; the step's gradients and loss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    trainer_env()
    distributed = mesh_shape is not None
    cfg = GRPOConfig(output_dir=out_dir, max_steps=1, per_device_train_batch_size=ROWS if distributed else WORLD * ROWS,
                     num_generations=GENERATIONS, max_completion_length=16, temperature=0.7, loss_type="dapo", beta=0.04,
                     optim="sgd", learning_rate=1.0, logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True,
                     save_strategy="no", seed=0, bf16=False, gradient_checkpointing=False)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model.config._name_or_path = ref_path  # TRL loads the reference in the policy's dtype
    common = dict(reward_funcs=[reward_length, reward_tokens], args=cfg, train_dataset=make_prompts(),
                  processing_class=AutoTokenizer.from_pretrained(tok_path))
    if distributed:
        from hf_longctx import patch
        from hf_longctx.training.grpo.trainer import LongGRPOTrainer

        class Trainer(GradSnapshot, FixedCompletions, LongGRPOTrainer):
            pass

        mesh = worker_mesh(*mesh_shape)
        trainer = Trainer(model=patch(model, mesh), mesh=mesh, **common)
    else:
        class Trainer(GradSnapshot, FixedCompletions, GRPOTrainer):
            pass

        trainer = Trainer(model=model, **common)
    trainer.train()
    return {"grads": trainer.grads, "loss": next(h["loss"] for h in trainer.state.log_history if "grad_norm" in h)}


@pytest.fixture(scope="module")
def bf16_paths(paths, tmp_path_factory):
    """The policy and reference with bf16-representable weights (stored fp32): float64 truth on the same values."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("grpo_bf16")
    out = []
    for name, path in (("policy", paths[0]), ("ref", paths[1])):
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(torch.float32).save_pretrained(str(root / name))
        out.append(str(root / name))
    return out[0], out[1], paths[2]


def test_grpo_trainer_bf16_within_twice_single_process_error(pools, bf16_paths, tmp_path):
    """bf16 weights on U2xR2 (dapo, beta 0.04) within the project's bf16 rule
    (tests/distributed/test_bf16.py): per gradient tensor (small ones pooled),
    ‖ours − truth‖ ≤ 2·‖single − truth‖ + 1e-6·‖truth‖, with truth the real single-process
    GRPOTrainer in float64 on the same bf16-representable weights and single the same trainer in bf16;
    the logged step loss, a scalar, by `scalar_excess` (the single-process error plus one bf16
    rounding; measured: gradient error ratios 0.96-1.15, loss error 6e-7 vs the single-process
    bf16's 2e-6)."""
    from tests.helpers.bf16_rule import criterion, pooled_small, scalar_excess

    truth = _run_dtype(*bf16_paths, str(tmp_path / "f64"), torch.float64, None)
    single = _run_dtype(*bf16_paths, str(tmp_path / "bf16"), torch.bfloat16, None)
    out = pools.get(WORLD).run(_run_dtype, *bf16_paths, str(tmp_path / "sp"), torch.bfloat16, (2, 2), timeout=300)
    g64, g1 = truth["grads"], single["grads"]
    assert set(g1) == set(g64) and max(v.abs().max().item() for v in g64.values()) > 1e-3
    for rank, res in enumerate(out):
        assert set(res["grads"]) == set(g64), f"rank {rank}: {sorted(res['grads'])}"
        rows = pooled_small([(k, g64[k], g1[k], res["grads"][k]) for k in g64])
        bad = {name: criterion(t, s, r) for name, t, s, r in rows if criterion(t, s, r)[0] > 0}
        assert not bad, f"rank {rank}: tensors beyond 2x the single-process bf16 error (excess, ratio): {bad}"
        assert scalar_excess(res["loss"], single["loss"], truth["loss"])[0] <= 0, \
            f"rank {rank}: loss {res['loss']} vs truth {truth['loss']} (single bf16 {single['loss']})"
