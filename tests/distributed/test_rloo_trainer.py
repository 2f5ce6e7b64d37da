"""`LongRLOOTrainer` (training/rloo/trainer.py) on 4 gloo ranks equals the REAL single-process TRL
`RLOOTrainer` over one optimizer step.

Generation is made deterministic by overriding TRL's RLOO generation hook identically in both
trainers (`tests/helpers/rloo_cases.py`); everything else is TRL's own: the dataset of text
prompts and its RepeatSampler, tokenization, two reward functions, the KL penalty in the reward,
leave-one-out advantages (4 generations per prompt: a prompt's completions straddle processes),
their normalisation, metrics, SGD. The 4 ranks run per_device_train_batch_size=3 (12 rows); the
reference one process with 12 (the same rows: an SP group trains on the union of its ranks' rows).
Tiny models saved with save_pretrained and loaded with from_pretrained; the reference model
(beta > 0) is a second checkpoint with perturbed weights, so the KL penalty moves the
advantages (and, through them, every gradient).

Checked on U2xR2 ("normalized": beta 0 with normalize_advantages; "kl": beta 0.05 with
reward_clip_range, also with max_tokens=40, which splits both the scoring forwards and the
training step into several packed micro-batches), on Ulysses 4 with FPDT chunks 2 ("kl", also under
`patch(memory="max")`: checkpointed row-chunked layers and the chunked LM head for the policy's and the
reference's scoring forwards and the loss) and on dp2xU2 ("kl": two DP groups train different rows, a prompt's completions straddle them):
the step loss (on-policy it is -mean(advantages) ~ 0: 1e-6 absolute, TRL's own loss there is
fp32 noise of that size), grad_norm (1e-4 relative), the parameter updates of one plain-SGD step
(lr 1, max_grad_norm 1: the clipped gradient; every parameter, 1e-4 relative) and every metric
TRL logs (reward, reward_std, rewards/<f>/*, frac_reward_zero_std, completions/*, num_tokens,
kl, entropy, clip ratios, learning_rate, epoch; 1e-5); step_time and tokens_per_s are wall-clock
and skipped. On-policy the ratio is 1, so the clip ratios are 0.
"""

from __future__ import annotations

import pytest

from tests.helpers.families import rel
from tests.helpers.grpo_cases import GRAD_TOL, METRIC_TOL, WORLD, assert_refused, paths  # noqa: F401  (paths: a fixture)
from tests.helpers.rloo_cases import CASES, run_rloo

LOSS_ABS = 1e-6
# (mesh (ulysses, ring, fpdt_chunks), [(case, max_tokens, patch(memory=...))])
MESHES = {"U2xR2": ((2, 2, 1), [("normalized", None, None), ("kl", 40, None)]),
          "U4-fpdt2": ((4, 1, 2), [("kl", None, None), ("kl", None, "max")]),
          "dp2xU2": ((2, 1, 1), [("kl", None, None)])}


@pytest.fixture(scope="module")
def references(paths, tmp_path_factory):
    pytest.importorskip("trl")
    out = tmp_path_factory.mktemp("rloo_ref")
    return {case: run_rloo(*paths, str(out / case), case, None) for case in CASES}


def _sp_cases(model_path, ref_path, tok_path, out_dir, mesh_shape, cases):
    return [run_rloo(model_path, ref_path, tok_path, f"{out_dir}/{case}-{max_tokens}-{memory}", case, mesh_shape,
                     max_tokens, memory) for case, max_tokens, memory in cases]


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_rloo_trainer_matches_single_process_trl(pools, paths, references, tmp_path, mesh):
    shape, cases = MESHES[mesh]
    for case, ref in references.items():
        assert ref["log"]["reward_std"] > 0 and ref["log"]["grad_norm"] > 0.1, f"{case}: a vacuous reference {ref['log']}"
        if CASES[case]["beta"]:
            assert abs(ref["log"]["kl"]) > 1e-3, f"{case}: the reference must differ from the policy"
        assert max(u.abs().max().item() for u in ref["updates"].values()) > 1e-4, f"{case}: no update"
    results = pools.get(WORLD).run(_sp_cases, *paths, str(tmp_path), shape, cases, timeout=600)
    for rank, per_case in enumerate(results):
        for (case, max_tokens, memory), got in zip(cases, per_case):
            ref, where = references[case], f"rank {rank} {mesh} {case} max_tokens={max_tokens} memory={memory}"
            assert set(got["log"]) == set(ref["log"]), f"{where}: logged keys {sorted(got['log'])} vs {sorted(ref['log'])}"
            assert abs(got["log"]["loss"] - ref["log"]["loss"]) <= LOSS_ABS, f"{where}: loss {got['log']} vs {ref['log']}"
            assert got["log"]["grad_norm"] == pytest.approx(ref["log"]["grad_norm"], rel=GRAD_TOL), where
            for name, want in ref["log"].items():
                if name != "loss":
                    assert got["log"][name] == pytest.approx(want, rel=METRIC_TOL, abs=METRIC_TOL), \
                        f"{where}: {name} {got['log'][name]} vs {want}"
            assert got["ref_sharded"] == bool(CASES[case]["beta"]), f"{where}: the reference must be FSDP2-sharded"
            assert (got["microbatches"] > 1) == (max_tokens is not None), f"{where}: {got['microbatches']} micro-batches"
            worst = max((rel(got["updates"][k], ref["updates"][k]), k) for k in ref["updates"])
            assert worst[0] <= GRAD_TOL, f"{where}: parameter update rel err {worst}"


@pytest.mark.parametrize("kw,match", [
    (dict(gradient_accumulation_steps=2), "gradient_accumulation_steps=2"),
    (dict(num_iterations=2), "num_iterations=2"),
    (dict(use_vllm=True), "use_vllm=True"),
    (dict(mask_truncated_completions=True), "mask_truncated_completions=True"),
    (dict(eval_strategy="steps", eval_steps=1), "evaluation"),
    (dict(sync_ref_model=True), "sync_ref_model=True"),
    (dict(num_iterations=2, use_vllm=True), r"use_vllm=True(.|\n)*num_iterations=2"),  # all listed at once
], ids=["grad_accum", "num_iterations", "vllm", "mask_truncated", "eval", "sync_ref", "together"])
def test_rloo_trainer_refusals(paths, tmp_path, kw, match):
    """Every refused setting raises NotSupported at construction, naming the value and a "Do instead"."""
    pytest.importorskip("trl")
    assert_refused(paths, tmp_path, "RLOO", kw, match)


def _clip_metrics(ulysses: int, ring: int) -> dict:
    """`rloo_loss`'s metric reduction on made-up indicators: 6 completions, 3 per DP group (every
    SP rank of a group holds all 3, as after `doc_sums`); low clipped: completions 0 and 4, high: 5;
    4 target tokens per rank with entropy rank + 1."""
    import torch
    import torch.distributed as dist

    from hf_longctx.training.rloo.loss import _metrics
    from tests.helpers.pool import worker_mesh

    mesh = worker_mesh(ulysses, ring)
    low = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]][mesh.dp_rank], dtype=torch.float64)  # [3]
    high = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]][mesh.dp_rank], dtype=torch.float64)  # [3]
    entropy = torch.full((1, 4), float(dist.get_rank() + 1), dtype=torch.float64)  # [1, S_local]
    return _metrics(torch.ones(1, 4, dtype=torch.float64), entropy, low, high, mesh)


def test_rloo_clip_metrics_count_each_completion_once(pools):
    """On dp2xU2 the clip means are over the 6 completions of the world (both DP groups'), the
    extremes over all of them, the entropy a token mean over every rank."""
    want = {"entropy": 2.5, "clip_ratio/low_mean": 2 / 6, "clip_ratio/low_min": 0.0, "clip_ratio/high_mean": 1 / 6,
            "clip_ratio/high_max": 1.0, "clip_ratio/region_mean": 3 / 6}
    for got in pools.get(WORLD).run(_clip_metrics, 2, 1, timeout=120):
        assert got == pytest.approx(want, abs=1e-12), got
