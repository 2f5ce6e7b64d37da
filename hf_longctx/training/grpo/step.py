"""One GRPO optimizer step under sequence parallelism, end to end: rollouts, rewards and
advantages, the exact SP training step, the optimizer step and TRL's metrics (global).

Where it sits: the loop body of recipes/grpo.py (and of a user's own loop): `sp_rollouts` ->
the caller's rewards -> TRL's group-relative advantages (DeepSeekMath §4.1.2,
`scale_rewards="group"`) -> `pack_completions` with the step's GLOBAL counts (one
all-reduce over DP) -> `shard_batch` -> reference log-probs on the same shard (beta > 0) ->
`grpo_loss` -> backward (gradients SUMMED) -> clip -> optimizer step. All G completions of
a prompt share one packed row, so the advantages are local. One micro-batch per step, no
old log-probabilities, no evaluation or callbacks: `LongGRPOTrainer` adds those through TRL."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from hf_longctx.distributed.loss import global_loss, sum_gradients
from hf_longctx.training.base.step_loop import grad_norm
from hf_longctx.training.grpo.generate import _fsdp_units, sp_rollouts
from hf_longctx.training.grpo.loss import GRPOObjective, add_ref_logps, grpo_loss, pack_completions, shard_completions


def group_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """TRL's scale_rewards="group": [N] rewards, prompt-major -> [N] advantages (NaN -> 0 as TRL:
    one generation per prompt has no std)."""
    if num_generations == 1:
        return torch.zeros_like(rewards, dtype=torch.float64)
    r = rewards.double().view(-1, num_generations)  # [prompts, G]
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)  # unbiased std, like TRL's nanstd
    return torch.nan_to_num(adv, nan=0.0).view(-1)  # [N]


def _dp_sum(values: list[float], mesh) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if mesh.dp > 1:
        dist.all_reduce(t, group=mesh.dp_group)  # [K]: Σ over DP groups (SP ranks hold identical values)
    return t.tolist()


def grpo_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, mesh, prompts: Sequence[Sequence[int]],
    reward_fn: Callable[[list[list[int]], list[list[int]]], Sequence[float]], objective: GRPOObjective, *,
    num_generations: int, generate: Callable, ref_model: torch.nn.Module | None = None,
    max_grad_norm: float | None = 1.0, pad_token_id: int = 0, step: int = 0,
) -> dict[str, Any]:
    """One optimizer step on this DP group's `prompts` (the same list on every rank of its SP
    group): generate, score, then one forward + backward of the packed rows under SP.

    The gradient norm and clipping are the Trainer path's (`base/step_loop.grad_norm`).

    Args:
        model: The policy, patched with `mesh`.
        optimizer: Its optimizer.
        mesh (SPMesh): This rank's mesh.
        prompts: This DP group's prompts as token lists (the same on every rank of its SP
            group).
        reward_fn: `reward_fn(prompts, completions)` -> one reward per completion.
        objective: The loss (`GRPOObjective`).
        num_generations: Completions per prompt.
        generate: `generate(model, prompt, n)` -> n completions (token lists, up to and
            including EOS), run on the unpatched, gathered model.
        ref_model: The reference, patched with the same mesh (needed when
            `objective.beta` != 0).
        max_grad_norm: Clip the gradient norm to this (None: no clipping).
        pad_token_id: The id of padding tokens.
        step: The step's number, for messages.

    Returns:
        The global loss, grad_norm, the reward mean, the completion length mean and TRL's
            loss metrics.

    Raises:
        ValueError: `beta` != 0 without `ref_model`, or `reward_fn` returned the wrong
            number of rewards.
        RankFailure: A collective of the gradient norm or clipping failed (naming `step`).
    """
    if objective.beta != 0.0 and ref_model is None:
        raise ValueError(f"beta={objective.beta} needs ref_model= (patched with the same mesh)")
    completions = sp_rollouts(model, prompts, mesh, num_generations=num_generations, generate=generate)
    per_completion_prompts = [list(p) for p in prompts for _ in range(num_generations)]  # prompt-major, as generated
    rewards = torch.as_tensor(list(reward_fn(per_completion_prompts, completions)), dtype=torch.float64)  # [N_local]
    if rewards.shape != (len(completions),):
        raise ValueError(f"reward_fn returned {tuple(rewards.shape)} rewards for {len(completions)} completions")
    advantages = group_advantages(rewards, num_generations)
    n, tokens, r_sum = _dp_sum([len(completions), sum(map(len, completions)), float(rewards.sum())], mesh)
    if tokens < 1:
        raise ValueError("no completion token in this step (every completion is empty); raise max_new_tokens")
    packed = pack_completions(per_completion_prompts, completions, advantages.tolist(), objective,
                              num_sequences=int(n), num_tokens=int(tokens))
    shard = shard_completions(packed, mesh, pad_token_id=pad_token_id)
    if objective.beta != 0.0:
        add_ref_logps(ref_model, shard, objective)
    model.train()
    loss, metrics = grpo_loss(model, shard, objective, mesh, num_sequences=int(n))
    loss.backward()
    if mesh.world_size > 1 and not _fsdp_units(model):  # FSDP2 reduce-scatters a sum itself; a replicated model needs it
        sum_gradients(model.parameters(), mesh)
    norm = grad_norm(model, max_grad_norm if max_grad_norm is not None else float("inf"), step)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": float(global_loss(loss, mesh)), "grad_norm": float(norm), "reward": r_sum / n,
            "completions/mean_length": tokens / n, **metrics}
