"""GRPO training step under SP (training/grpo/loss.py) equals a single-process GRPO step.

Generation is taken out of the comparison: fixed completions, advantages, old-policy and
reference log-probabilities are injected (the old ones perturbed away from the current policy
so that both clipping sides fire). The reference is hand-computed in one process with TRL
1.16's `_compute_loss` formulas on a padded [N, L] completion batch (the unpatched model run
on each prompt+completion alone), not TRL's trainer: its fused LM head and left-padded
prompts are not what is under test. Checked on 4 gloo ranks, U2×R2 (one SP group of 4),
dp2×U2 (two DP groups on different completions) and dp2×U2 with FPDT chunks 2: the step loss, every parameter gradient,
grad_norm and TRL's logged metrics (kl, entropy, clip ratios, low_min / high_max), for each
supported loss_type with beta > 0 (TRL's default use_bias_correction_kl=True, and False once), and
for "grpo" on-policy with beta = 0, and with two-sided clipping (delta); fp32, loss 1e-5 and
gradients 1e-4 relative (tests/distributed/test_models.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.families import load, rel, save_family
from tests.helpers.pool import worker_mesh
from tests.helpers.grpo_reference import EPS_HIGH, EPS_LOW, MAX_LEN, TEMPERATURE, make_rollouts, reference_step

LOSS_TOL = 1e-5
GRAD_TOL = 1e-4
METRIC_TOL = 1e-6  # ratios of fp32 quantities counted identically; kl / entropy as fp32 means
# (loss_type, beta, old log-probs injected, use_bias_correction_kl, delta)
CASES = [("grpo", 0.04, True, True, None), ("dr_grpo", 0.04, True, True, None), ("dapo", 0.04, True, True, None),
         ("grpo", 0.0, False, True, None), ("dapo", 0.04, False, False, None), ("grpo", 0.04, True, True, 1.1)]


def _sp_steps(ulysses: int, ring: int, fpdt: int, path: str) -> list[dict]:
    from hf_longctx.integrations.model_patch import patch
    from hf_longctx.distributed.loss import global_loss, sum_gradients
    from hf_longctx.training.grpo.loss import GRPOObjective, grpo_loss, pack_completions, shard_completions

    mesh = worker_mesh(ulysses, ring, fpdt)
    rollouts = make_rollouts()
    prompts, completions, advantages, _, _ = rollouts
    n = len(completions)
    mine = range(mesh.dp_rank * n // mesh.dp, (mesh.dp_rank + 1) * n // mesh.dp)  # this DP group's completions
    results = []
    for loss_type, beta, with_old, correction, delta in CASES:
        ref_loss, ref_grads, ref_metrics, (old, refl) = reference_step(load(path), rollouts, loss_type, beta, with_old,
                                                                       correction, delta)
        objective = GRPOObjective(loss_type=loss_type, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, beta=beta,
                                  temperature=TEMPERATURE, max_completion_length=MAX_LEN, use_bias_correction_kl=correction,
                                  delta=delta)
        packed = pack_completions(
            [prompts[i] for i in mine], [completions[i] for i in mine], [advantages[i] for i in mine], objective,
            num_sequences=n, num_tokens=sum(len(c) for c in completions),
            old_logps=[old[i] for i in mine] if with_old else None, ref_logps=[refl[i] for i in mine] if beta else None,
        )
        model = patch(load(path), mesh)
        model.zero_grad(set_to_none=True)
        loss, metrics = grpo_loss(model, shard_completions(packed, mesh), objective, mesh, num_sequences=n)
        loss.backward()
        sum_gradients(model.parameters(), mesh)
        grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
        norm = torch.nn.utils.get_total_norm(list(grads.values()))
        ref_norm = torch.nn.utils.get_total_norm(list(ref_grads.values()))
        results.append({
            "case": (loss_type, beta, with_old, correction, delta),
            "loss": rel(global_loss(loss, mesh), ref_loss),
            "grad": max(rel(grads[k], ref_grads[k]) for k in ref_grads),
            "same_params": set(grads) == set(ref_grads),
            "grad_norm": rel(norm, ref_norm),
            "metrics": {k: (metrics.get(k), v) for k, v in ref_metrics.items()},
            "extra_metrics": sorted(set(metrics) - set(ref_metrics)),
            "share": loss.item() / ref_loss.item(),
        })
    return results


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return save_family("llama", tmp_path_factory.mktemp("grpo"))


@pytest.mark.parametrize("ulysses,ring,fpdt", [(2, 2, 1), (2, 1, 1), (2, 1, 2)], ids=["U2xR2", "dp2xU2", "dp2xU2-fpdt2"])
def test_grpo_step_matches_single_process(pools, llama_path, ulysses, ring, fpdt):
    results = pools.get(4).run(_sp_steps, ulysses, ring, fpdt, llama_path, timeout=300)
    for rank, per_case in enumerate(results):
        for r in per_case:
            where = f"rank {rank} mesh U{ulysses}xR{ring} case {r['case']}"
            assert r["same_params"] and not r["extra_metrics"], f"{where}: {r}"
            assert r["loss"] <= LOSS_TOL, f"{where}: loss rel err {r['loss']}"
            assert r["grad"] <= GRAD_TOL and r["grad_norm"] <= GRAD_TOL, f"{where}: grad rel err {r}"
            for name, (got, want) in r["metrics"].items():
                assert got == pytest.approx(want, rel=METRIC_TOL, abs=METRIC_TOL), f"{where}: {name} {got} vs {want}"
    for i in range(len(CASES)):  # each rank holds a share of the loss, not all of it
        shares = [per_case[i]["share"] for per_case in results]
        assert sum(shares) == pytest.approx(1.0, abs=1e-5) and all(abs(s - 1.0) > 1e-3 for s in shares), shares
    clipped = [r["metrics"]["clip_ratio/low_mean"][1] + r["metrics"]["clip_ratio/high_mean"][1] for r in results[0]]
    assert min(clipped[:3]) > 0, "the injected old log-probabilities must make clipping fire"
