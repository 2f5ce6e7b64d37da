"""GRPO end to end through real generation on 2 ranks (Ulysses 2, FSDP2 over both): the ranks
generate DIFFERENT numbers of tokens in a different number of `generate` calls (3 prompts
split 2/1; a per-prompt max_new_tokens) and the
step finishes without a hang (training/grpo/generate.py: gathered weights outside FSDP's
per-forward all-gathers). Checked: the forward counts inside generate differ across ranks;
both ranks end up with the same completions, equal to seeded sampling with `generate` of the
unsharded model; the model is sharded and patched again after generation (two steps run); and the
gradients of the first step (FSDP2's reduce-scattered sum) equal the same GRPO step in one
process (fp32, 1e-4 relative). And grpo_step with `SamplingSettings` (sequence-parallel generation):
the same completions (ragged) and the same step as one process under the same seed.
"""

from __future__ import annotations

import torch

from tests.helpers.families import load, rel, save_family
from tests.helpers.pool import worker_mesh

LR = 0.5
EOS = 3
PROMPTS = [[5, 17, 42, 9], [8, 8, 31], [60, 2, 77, 14, 90, 21]]  # 3 prompts over 2 ranks: 2 generate calls vs 1


def _generate(model, prompt: list[int], n: int) -> list[list[int]]:
    from hf_longctx.training.grpo.generate import hf_generate

    torch.manual_seed(sum(prompt))  # sampling seeded by the prompt: the same samples on any rank and in the reference
    return hf_generate(max_new_tokens=2 * len(prompt), eos_token_id=EOS, do_sample=True)(model, prompt, n)


def _rewards(completions: list[list[int]]) -> torch.Tensor:
    return torch.tensor([float(sum(t % 2 for t in c)) + 0.1 * len(c) for c in completions])  # a made-up token reward


def _advantages(rewards: torch.Tensor, g: int) -> list[float]:
    """TRL's default (scale_rewards="group"): reward minus its group mean, over the group std + 1e-4."""
    r = rewards.view(-1, g)  # [prompts, G]
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1).tolist()


def _step(model, mesh, completions, g):
    from hf_longctx.training.grpo.loss import GRPOObjective, grpo_loss, pack_completions, shard_completions

    obj = GRPOObjective(loss_type="grpo", beta=0.0)
    prompts = [p for p in PROMPTS for _ in range(g)]
    packed = pack_completions(prompts, completions, _advantages(_rewards(completions), g), obj,
                              num_sequences=len(completions), num_tokens=sum(map(len, completions)))
    loss, metrics = grpo_loss(model, shard_completions(packed, mesh), obj, mesh, num_sequences=len(completions))
    loss.backward()
    return metrics


def _run(path: str) -> dict:
    from torch.distributed.tensor import DTensor

    from hf_longctx.distributed.mesh import SPMesh
    from hf_longctx.integrations.accelerate import fsdp_plan
    from hf_longctx.integrations.model_patch import is_patched, patch
    from hf_longctx.training.grpo.generate import sp_rollouts

    g = 2
    # single-process reference: world-1 mesh, same rollouts and step
    one = SPMesh(dp=1, ring=1, ulysses=1, fpdt_chunks=1, dp_rank=0, ring_rank=0, ulysses_rank=0)
    ref_model = patch(load(path), one)
    ref_completions = sp_rollouts(ref_model, PROMPTS, one, num_generations=g, generate=_generate)
    ref_metrics = _step(ref_model, one, ref_completions, g)
    ref_grads = {n: p.grad.detach().clone() for n, p in ref_model.named_parameters()}

    mesh = worker_mesh(2, 1)
    model = patch(load(path), mesh)
    fsdp_plan(model, mesh, mixed_precision="fp32").apply(model)
    forwards = []  # forwards inside generate() on this rank

    def counted(m, prompt, n):
        hook = m.register_forward_pre_hook(lambda *a: forwards.append(1))
        try:
            return _generate(m, prompt, n)
        finally:
            hook.remove()

    completions = sp_rollouts(model, PROMPTS, mesh, num_generations=g, generate=counted)
    sharded_again = all(isinstance(p, DTensor) for p in model.parameters()) and is_patched(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    metrics = _step(model, mesh, completions, g)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}  # reduce-scattered (summed) by FSDP2
    opt.step()
    opt.zero_grad()
    second = sp_rollouts(model, PROMPTS, mesh, num_generations=g, generate=_generate)  # after a sharded step
    _step(model, mesh, second, g)
    opt.step()
    return {"forwards": len(forwards), "same_as_reference": completions == ref_completions,
            "completions": completions, "sharded_again": sharded_again,
            "grad": max(rel(grads[n], ref_grads[n]) for n in ref_grads),
            "entropy": (metrics["entropy"], ref_metrics["entropy"]), "grad_max": max(g.abs().max().item() for g in ref_grads.values())}


def test_ragged_generation_two_ranks_no_hang(pools, tmp_path):
    path = save_family("llama", tmp_path)
    results = pools.get(2).run(_run, path, timeout=240)
    assert results[0]["forwards"] != results[1]["forwards"], "the ranks must run different numbers of forwards"
    assert results[0]["completions"] == results[1]["completions"]
    lengths = {len(c) for c in results[0]["completions"]}
    assert len(lengths) > 1, lengths
    for r in results:
        assert r["same_as_reference"] and r["sharded_again"], r
        assert r["grad"] <= 1e-4, r["grad"]
        assert r["grad_max"] > 1e-3  # non-zero advantages: the gradient comparison is not vacuous
        assert abs(r["entropy"][0] - r["entropy"][1]) <= 1e-5 * abs(r["entropy"][1])


def _mismatched(path: str) -> str:
    from hf_longctx.integrations.accelerate import fsdp_plan
    from hf_longctx.integrations.model_patch import patch
    from hf_longctx.training.grpo.generate import sp_rollouts

    mesh = worker_mesh(2, 1)
    model = patch(load(path), mesh)
    fsdp_plan(model, mesh, mixed_precision="fp32").apply(model)
    prompts = PROMPTS if mesh.sp_rank == 0 else PROMPTS[::-1]  # seeded by global rank: a user mistake
    try:
        sp_rollouts(model, prompts, mesh, num_generations=1, generate=_generate)
    except ValueError as e:
        return str(e)
    return "no error"


def test_different_prompts_in_one_sp_group_raise_on_every_rank(pools, tmp_path):
    path = save_family("llama", tmp_path)
    for msg in pools.get(2).run(_mismatched, path, timeout=120):
        assert "different prompts" in msg and "by DP rank" in msg, msg


class _Capture:
    """An optimizer stand-in for grpo_step: records the (full) gradients its step() sees."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def step(self):
        self.grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                      for n, p in self.model.named_parameters() if p.grad is not None}

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


def _against_one_process(path: str, run) -> dict:
    """`run(model, mesh)` -> (logs, grads) on one process, then on U2 with the model FSDP2-sharded
    and replicated: per kind the largest gradient error and the (got, reference) logs."""
    from hf_longctx.distributed.mesh import SPMesh
    from hf_longctx.integrations.accelerate import fsdp_plan
    from hf_longctx.integrations.model_patch import patch

    one = SPMesh(dp=1, ring=1, ulysses=1, fpdt_chunks=1, dp_rank=0, ring_rank=0, ulysses_rank=0)
    ref_logs, ref_grads = run(patch(load(path), one), one)
    mesh = worker_mesh(2, 1)
    out = {}
    for kind in ("fsdp", "replicated"):
        model = patch(load(path), mesh)
        if kind == "fsdp":
            fsdp_plan(model, mesh, mixed_precision="fp32").apply(model)
        logs, grads = run(model, mesh)
        out[kind] = {"grad": max(rel(grads[n], ref_grads[n]) for n in ref_grads),
                     "logs": {k: (logs[k], v) for k, v in ref_logs.items()}}
    return out


def _grpo_steps(path: str) -> dict:
    from hf_longctx.integrations.model_patch import patch
    from hf_longctx.training.grpo.step import grpo_step
    from hf_longctx.training.grpo.loss import GRPOObjective

    obj = GRPOObjective(loss_type="dr_grpo", beta=0.04, max_completion_length=12)
    reward = lambda ps, cs: _rewards(cs).tolist()  # noqa: E731

    def run(model, mesh):
        opt = _Capture(model)
        ref = patch(load(path), mesh)
        logs = grpo_step(model, opt, mesh, PROMPTS, reward, obj, num_generations=2, generate=_generate, ref_model=ref,
                         max_grad_norm=None)
        return logs, opt.grads

    return _against_one_process(path, run)


def test_grpo_step_on_two_ranks_equals_one_process(pools, tmp_path):
    """grpo_step end to end (rollouts, rewards, advantages, global counts, reference log-probs on
    the shard, loss, gradient sum): FSDP2 and a replicated model on U2 equal one process."""
    path = save_family("llama", tmp_path)
    for rank, out in enumerate(pools.get(2).run(_grpo_steps, path, timeout=240)):
        for kind, r in out.items():
            assert r["grad"] <= 1e-4, (rank, kind, r["grad"])
            for name, (got, want) in r["logs"].items():
                assert abs(got - want) <= 1e-5 * max(abs(want), 1e-3), (rank, kind, name, got, want)


def _grpo_steps_sp_generation(path: str) -> dict:
    """grpo_step with SamplingSettings (sequence-parallel generation, SP rank 0 sampling every row) on
    U2 (FSDP2 and replicated) against the same call on one process, seeded alike."""
    from hf_longctx.generation.settings import sampling_settings
    from hf_longctx.training.grpo.loss import GRPOObjective
    from hf_longctx.training.grpo.step import grpo_step

    obj = GRPOObjective(loss_type="dapo", beta=0.0)
    settings = sampling_settings(max_new_tokens=8, do_sample=True, temperature=0.8, top_k=40,
                                 eos_token_id=list(range(3, 128, 4)), pad_token_id=0)  # a quarter of the ids stop
    reward = lambda ps, cs: _rewards(cs).tolist()  # noqa: E731
    captured = {}

    def run(model, mesh):
        opt = _Capture(model)
        torch.manual_seed(7)
        seen = []
        logs = grpo_step(model, opt, mesh, PROMPTS, lambda ps, cs: seen.append(cs) or reward(ps, cs), obj,
                         num_generations=2, generate=settings, max_grad_norm=None, step=1)
        captured.setdefault("completions", []).append(seen[0])
        return logs, opt.grads

    out = _against_one_process(path, run)
    out["completions"] = captured["completions"]
    return out


def test_grpo_step_sp_generation_on_two_ranks_equals_one_process(pools, tmp_path):
    """grpo_step's sequence-parallel generation: the same completions as one process (the same seed)
    with ragged lengths, the same step (gradients 1e-4, logs 1e-5 relative)."""
    path = save_family("llama", tmp_path)
    for rank, out in enumerate(pools.get(2).run(_grpo_steps_sp_generation, path, timeout=240)):
        ref, fsdp, replicated = out.pop("completions")
        assert fsdp == ref and replicated == ref, (rank, ref, fsdp, replicated)
        assert len({len(c) for c in ref}) > 1, ref
        for kind, r in out.items():
            assert r["grad"] <= 1e-4, (rank, kind, r["grad"])
            for name, (got, want) in r["logs"].items():
                assert abs(got - want) <= 1e-5 * max(abs(want), 1e-3), (rank, kind, name, got, want)
