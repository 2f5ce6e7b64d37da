"""The RLOO training step under sequence parallelism: TRL's sequence-level clipped REINFORCE
objective on a packed, sharded batch of prompt+completion documents, exact against the
single-process step.

Where it sits: after TRL's `RLOOTrainer` scored the rollouts (rewards, the KL penalty in the
reward from the SP scoring pass `grpo/scoring.py`, leave-one-out advantages: RLOO paper
(Ahmadian et al. 2024) §3 as TRL 1.16 implements it), in place of `RLOOTrainer._compute_loss`.
The objective is per COMPLETION: its log-prob sum `s_i`, the ratio exp(s_i - s_old_i)
clipped by epsilon, times the advantage, averaged over the step's N completions. Each
completion's tokens are spread over its SP group, so `s_i` is a differentiable per-document sum
(`distributed/doc_sums.py`, identical on every SP rank, backward all-reduced over the group);
every SP rank computes the same per-completion losses and takes 1/sp of them: this rank's
share is Σ_i loss_i / (N · sp), the shares sum to TRL's mean and the summed gradients to its
gradient. On-policy (num_iterations = 1) the old sums are the loss forward's own, detached.
Metrics (entropy, clip ratios over completions) are global."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from hf_longctx.distributed.doc_sums import doc_sums, target_mask
from hf_longctx.training.grpo.loss import shard_token_logps


@dataclass(frozen=True)
class RLOOObjective:
    """TRL's RLOOConfig fields that define the loss and the log-probs (same names and defaults)."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.05
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")

    @classmethod
    def from_config(cls, args: Any) -> "RLOOObjective":
        """From a TRL `RLOOConfig`; every refused field raises first (`refusals.rloo.check_rloo_config`)."""
        from hf_longctx.training.refusals.rloo import check_rloo_config

        check_rloo_config(args)
        eps = args.epsilon
        return cls(epsilon_low=eps, epsilon_high=args.epsilon_high if args.epsilon_high is not None else eps,
                   beta=args.beta, temperature=args.temperature)


def rloo_loss(model: torch.nn.Module, shard: dict[str, Any], objective: RLOOObjective, mesh,
              advantages: Sequence[float], num_sequences: int) -> tuple[torch.Tensor, dict[str, float]]:
    """This rank's share of TRL's RLOO loss on its shard, and TRL's logged metrics, global.

    `shard`: a `shard_batch` of `grpo.loss.pack_rows` (one document per completion, in order);
    `advantages`: one per document, the same list on every rank of the SP group; `num_sequences`:
    N, the completions of the whole optimizer step over every DP group. Returns (loss, metrics):
    `loss` [] differentiable; `metrics`: entropy (token mean), clip_ratio/{low,high,region}_mean
    (means over completions), clip_ratio/low_min, high_max, identical on every rank. A collective
    over the world: every rank calls it once per micro-batch."""
    logps, entropy, loss_dtype = shard_token_logps(model, shard, objective.temperature)  # [1, S_local] each
    mask = target_mask(shard)  # [1, S_local]
    seq = doc_sums(logps, shard, mesh, mask=mask)[0].double()  # [D]: every completion's log-prob sum, every SP rank
    adv = torch.as_tensor(list(advantages), dtype=torch.float64, device=seq.device)  # [D]
    if adv.shape != seq.shape:  # the same shapes on every rank: all raise, before the loss's collectives
        raise ValueError(f"{adv.numel()} advantages for the {seq.numel()} completions of this packed row")
    coef_1 = torch.exp(seq - seq.detach())  # on-policy: the old sums are these, detached (value 1, gradient of s_i)
    coef_2 = torch.clamp(coef_1, 1 - objective.epsilon_low, 1 + objective.epsilon_high)
    per_sequence = -torch.min(coef_1 * adv, coef_2 * adv)  # [D]
    loss = per_sequence.sum() / (num_sequences * mesh.sp)
    low = ((coef_1 < 1 - objective.epsilon_low) & (adv < 0)).double().detach()  # [D]
    high = ((coef_1 > 1 + objective.epsilon_high) & (adv > 0)).double().detach()  # [D]
    metrics = _metrics(mask.double(), entropy.double(), low, high, mesh)
    return loss.to(loss_dtype), metrics  # fp32 (fp64 models: fp64), never bf16


def _metrics(mask: torch.Tensor, entropy: torch.Tensor, low: torch.Tensor, high: torch.Tensor, mesh) -> dict[str, float]:
    """TRL's `_compute_loss` metrics of this micro-batch, global: the entropy's token mean, the
    clip indicators' means, minimum and maximum over the completions."""
    region = torch.maximum(low, high)
    # Every SP rank of a group holds all its completions: their sums and their count both come sp times, the means once.
    totals = torch.stack([(entropy * mask).sum(), mask.sum(), low.sum(), high.sum(), region.sum(),
                          torch.ones_like(low).sum()])  # [6]
    ext = torch.stack([low.min(), -high.max()])  # [2]: both as minima, one MIN all-reduce
    if mesh.world_size > 1:
        dist.all_reduce(totals, group=mesh.world_mesh.get_group())  # [6]: Σ over every rank
        dist.all_reduce(ext, op=dist.ReduceOp.MIN, group=mesh.world_mesh.get_group())  # [2]: over every completion
    n = totals[5].clamp_min(1.0)
    return {"entropy": float(totals[0] / totals[1].clamp_min(1.0)), "clip_ratio/low_mean": float(totals[2] / n),
            "clip_ratio/low_min": float(ext[0]), "clip_ratio/high_mean": float(totals[3] / n),
            "clip_ratio/high_max": float(-ext[1]), "clip_ratio/region_mean": float(totals[4] / n)}
