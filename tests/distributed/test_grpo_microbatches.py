"""`LongGRPOTrainer(max_tokens=...)`: one optimizer step split into several packed micro-batches
(training/grpo/microbatches.py) equals the REAL single-process TRL `GRPOTrainer` step.

Same setup as tests/distributed/test_grpo_trainer.py (its `_run`, `FixedCompletions`, the two
reward functions, a reference checkpoint different from the policy): 4 gloo ranks, 12 rows of
prompt (3-11 words) + completion (1-10 tokens), against one process drawing all 12 rows.
max_tokens=32 holds two or three rows, so every rank runs >= 2 micro-batches (U2xR2: the group's
12 rows; dp2xU2: 6 rows per group, the groups agree on the larger count). Checked for loss_type
"grpo" and "dapo" with beta 0.04 (KL on, the reference forward per micro-batch): the step loss
(1e-5 relative + 1e-8), grad_norm (1e-4 relative), every parameter after one plain-SGD step
(1e-4 relative) and every metric TRL logs (1e-5; step_time and tokens_per_s skipped). Also: a prompt+completion
longer than max_tokens is refused on every rank together before any forward (no rank left in a
collective: the ranks all-reduce afterwards), and bad max_tokens values at construction.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.grpo_cases import (  # noqa: F401  (paths: the shared checkpoints fixture)
    FixedCompletions, GRAD_TOL, LOSS_TOL, METRIC_TOL, WORLD, _run, make_prompts, paths, reward_length, reward_tokens,
)
from tests.helpers.families import rel
from tests.helpers.pool import worker_mesh
from tests.helpers.trainer_cases import trainer_env

MAX_TOKENS = 32
CASES = [("grpo", 0.04), ("dapo", 0.04)]


@pytest.fixture(scope="module")
def references(paths, tmp_path_factory):
    pytest.importorskip("trl")
    out = tmp_path_factory.mktemp("grpo_mb_ref")
    return {case: _run(*paths, str(out / f"{case[0]}-{case[1]}"), *case, None) for case in CASES}


def _mb_cases(model_path, ref_path, tok_path, out_dir, ulysses, ring):
    return [_run(model_path, ref_path, tok_path, f"{out_dir}/{t}-{b}", t, b, (ulysses, ring), max_tokens=MAX_TOKENS)
            for t, b in CASES]


@pytest.mark.parametrize("ulysses,ring", [(2, 2), (2, 1)], ids=["U2xR2", "dp2xU2"])
def test_grpo_microbatches_match_single_process_trl(pools, paths, references, tmp_path, ulysses, ring):
    results = pools.get(WORLD).run(_mb_cases, *paths, str(tmp_path), ulysses, ring, timeout=600)
    for case, ref in references.items():
        assert ref["log"]["reward_std"] > 0 and ref["log"]["grad_norm"] > 0.1 and ref["log"]["kl"] > 1e-4, ref["log"]
    counts = [[got["microbatches"] for got in per_case] for per_case in results]  # [rank][case]
    assert all(c == counts[0] for c in counts), f"ranks ran different numbers of micro-batches: {counts}"
    for rank, per_case in enumerate(results):
        for case, got in zip(CASES, per_case):
            ref = references[case]
            where = f"rank {rank} ulysses={ulysses} ring={ring} {case} micro-batches={got['microbatches']}"
            assert got["microbatches"] >= 2, f"{where}: max_tokens={MAX_TOKENS} must split the step"
            assert set(got["log"]) == set(ref["log"]), f"{where}: logged keys {sorted(got['log'])} vs {sorted(ref['log'])}"
            assert abs(got["log"]["loss"] - ref["log"]["loss"]) <= LOSS_TOL * abs(ref["log"]["loss"]) + 1e-8, \
                f"{where}: loss {got['log']['loss']} vs {ref['log']['loss']}"
            assert got["log"]["grad_norm"] == pytest.approx(ref["log"]["grad_norm"], rel=GRAD_TOL), where
            for name, want in ref["log"].items():
                assert got["log"][name] == pytest.approx(want, rel=METRIC_TOL, abs=METRIC_TOL), \
                    f"{where}: {name} {got['log'][name]} vs {want}"
            worst = max((rel(got["updates"][k], ref["updates"][k]), k) for k in ref["updates"])
            assert worst[0] <= GRAD_TOL, f"{where}: parameter update rel err {worst}"


def _overlong(model_path: str, tok_path: str, out_dir: str, max_tokens: int) -> dict:
    """One step whose rows (up to ~22 tokens) do not all fit max_tokens; the error and the policy
    forwards that ran before it; then a world all-reduce (hangs if a rank were left behind)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from hf_longctx import patch
    from hf_longctx.training.grpo.trainer import LongGRPOTrainer

    trainer_env()

    class Trainer(FixedCompletions, LongGRPOTrainer):
        pass

    cfg = GRPOConfig(output_dir=out_dir, max_steps=1, per_device_train_batch_size=3, num_generations=2,
                     max_completion_length=max_tokens - 1, loss_type="dapo", optim="sgd", report_to=[], use_cpu=True,
                     disable_tqdm=True, save_strategy="no", bf16=False, gradient_checkpointing=False)
    mesh = worker_mesh(2, 1)
    model = patch(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), mesh)
    forwards = []
    model.register_forward_pre_hook(lambda *a: forwards.append(1))
    trainer = Trainer(model=model, mesh=mesh, max_tokens=max_tokens, reward_funcs=[reward_length], args=cfg,
                      train_dataset=make_prompts(), processing_class=AutoTokenizer.from_pretrained(tok_path))
    try:
        trainer.train()
        error = None
    except ValueError as exc:
        error = str(exc)
    alive = torch.ones(1)
    dist.all_reduce(alive)  # every rank reaches it: none is waiting in a collective the others skipped
    return {"error": error, "forwards": len(forwards), "alive": float(alive)}


def test_grpo_microbatches_overlong_row_refused_on_every_rank(pools, paths, tmp_path):
    model_path, _, tok_path = paths
    out = pools.get(WORLD).run(_overlong, model_path, tok_path, str(tmp_path), 17, timeout=300)
    for rank, res in enumerate(out):
        assert res["error"] is not None and "does not fit max_tokens=17" in res["error"], f"rank {rank}: {res}"
        assert "Do instead" in res["error"] or "do instead" in res["error"], res["error"]
        assert res["forwards"] == 0, f"rank {rank}: the policy ran {res['forwards']} forwards before the refusal"
        assert res["alive"] == WORLD, res
    assert len({r["error"] for r in out}) == 1, [r["error"] for r in out]  # the same row named on every rank


@pytest.mark.parametrize("max_tokens,exc,match", [
    (0, ValueError, "max_tokens must be a positive int"),
    (True, ValueError, "max_tokens must be a positive int"),
    (10, "NotSupported", r"max_tokens=10 < max_completion_length=16 \+ 1"),
])
def test_grpo_microbatches_bad_max_tokens_refused_at_construction(paths, tmp_path, max_tokens, exc, match):
    pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from hf_longctx import NotSupported, init_sequence_parallel, patch
    from hf_longctx.training.grpo.trainer import LongGRPOTrainer

    cfg = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, max_completion_length=16,
                     report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False, save_strategy="no")
    mesh = init_sequence_parallel()
    with pytest.raises(NotSupported if exc == "NotSupported" else exc, match=match):
        LongGRPOTrainer(model=patch(AutoModelForCausalLM.from_pretrained(paths[0]), mesh), mesh=mesh,
                        max_tokens=max_tokens, reward_funcs=[reward_length], args=cfg, train_dataset=make_prompts(),
                        processing_class=AutoTokenizer.from_pretrained(paths[2]))
