"""The GRPO training step under sequence parallelism: TRL's per-token objective on a packed,
sharded batch of prompt+completion documents, exact against the single-process step.

Where it sits: after generation and scoring (completions, advantages, optionally old-policy
and reference log-probabilities), in place of TRL's `GRPOTrainer._compute_loss`.
`pack_completions` lays an SP group's completions out as ONE packed row with every
per-completion quantity at the position that PREDICTS each completion token, so
`shard_batch` carries it to the rank that scores the token; `grpo_loss` returns this rank's
share of TRL's loss (DeepSeekMath §4.1.2 eq. 3 as TRL 1.16 implements it). Guarantees: each
`loss_type`'s normaliser is a per-token weight from the unsharded lengths, so no cross-rank
reduction is needed and summed gradients equal the single-process ones; metrics are global.
Weights and metric reductions: docs/DESIGN.md "GRPO under SP"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from hf_longctx.data.sharding import IGNORE_INDEX, SP_METADATA_KEY, shard_batch
from hf_longctx.integrations.logprob_head import token_logprobs
from hf_longctx.model_walk import hf_model

SUPPORTED_LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
_KEYS = ("grpo_weight", "grpo_advantage", "grpo_old_logps", "grpo_ref_logps", "grpo_doc")
_MODEL_KEYS = ("input_ids", "position_ids", "shift_labels", SP_METADATA_KEY)  # the forward's inputs and targets


@dataclass(frozen=True)
class GRPOObjective:
    """TRL's GRPOConfig fields that define the per-token loss (same names and defaults).

    `GRPOObjective.from_config(grpo_config)` takes them from a TRL `GRPOConfig`.

    Args:
        loss_type: "grpo", "dr_grpo" or "dapo" (the token weighting of the loss).
        epsilon_low: The lower clipping range of the importance ratio (TRL's `epsilon`).
        epsilon_high: The upper clipping range of the importance ratio.
        beta: The KL coefficient against the reference (0: no reference).
        delta: An upper bound of the ratio on the other side of the clip (two-sided
            clipping), or None.
        temperature: The logits are divided by it, as at sampling.
        max_completion_length: The normaliser of "dr_grpo".
        use_bias_correction_kl: The KL term times the importance ratio (TRL 1.16's default).

    Raises:
        ValueError: A loss type not supported under SP ("bnpo" among them), a temperature
            <= 0 or a `max_completion_length` < 1.
    """

    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    delta: float | None = None
    temperature: float = 1.0
    max_completion_length: int = 256
    use_bias_correction_kl: bool = True  # TRL 1.16's default: the KL term times the importance ratio

    def __post_init__(self) -> None:
        if self.loss_type not in SUPPORTED_LOSS_TYPES:
            raise ValueError(
                f"loss_type={self.loss_type!r} is not supported under sequence parallelism; use one of "
                f"{SUPPORTED_LOSS_TYPES} (\"bnpo\" depends on how completions fall on ranks: use \"dapo\", its global "
                "token mean)"
            )
        if self.temperature <= 0 or self.max_completion_length < 1:
            raise ValueError(f"temperature must be > 0 and max_completion_length >= 1, got {self.temperature!r}, "
                             f"{self.max_completion_length!r}")

    @classmethod
    def from_config(cls, args: Any) -> "GRPOObjective":
        """From a TRL `GRPOConfig` (after its __post_init__: epsilon_high defaults to epsilon).

        Args:
            args: A TRL `GRPOConfig`.

        Returns:
            Its loss fields.

        Raises:
            NotSupported: Every refused field, first (`refusals.grpo.check_grpo_config`).
        """
        from hf_longctx.training.refusals.grpo import check_grpo_config

        check_grpo_config(args)
        eps = args.epsilon
        return cls(loss_type=args.loss_type, epsilon_low=eps, epsilon_high=args.epsilon_high if args.epsilon_high is not None else eps,
                   beta=args.beta, delta=args.delta, temperature=args.temperature,
                   max_completion_length=args.max_completion_length, use_bias_correction_kl=args.use_bias_correction_kl)

    def weights(self, lengths: Sequence[int], num_sequences: int, num_tokens: int) -> list[float]:
        """Per-completion token weight of the loss (module docstring).

        Args:
            lengths: Each completion's token count.
            num_sequences: Completions of the whole step (global).
            num_tokens: Completion tokens of the whole step (global).

        Returns:
            One weight per completion, for each of its tokens.

        Raises:
            ValueError: A global count < 1.
        """
        if num_sequences < 1 or num_tokens < 1:
            raise ValueError(f"num_sequences and num_tokens must be >= 1 (global counts), got {num_sequences}, {num_tokens}")
        if self.loss_type == "grpo":
            return [1.0 / (num_sequences * max(n, 1)) for n in lengths]  # TRL: mask.sum(-1).clamp(min=1)
        if self.loss_type == "dr_grpo":
            return [1.0 / (num_sequences * self.max_completion_length)] * len(lengths)
        return [1.0 / num_tokens] * len(lengths)


def _check_rows(name: str, rows: Sequence[Any] | None, lengths: list[int]) -> None:
    if rows is None:
        return
    got = [len(r) for r in rows]
    if got != lengths:
        raise ValueError(f"{name}: one value per completion token expected, lengths {got} vs completions {lengths}")


def pack_rows(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """One packed row [1, S] of prompt+completion documents, in order: input_ids, position_ids
    (restarting per document) and labels (HF unshifted: -100 on the prompt, the completion's
    tokens as targets). Completion token t of row i is predicted at its document's position
    len(prompt_i) - 1 + t."""
    if any(len(p) < 1 for p in prompts):
        raise ValueError("every prompt needs at least one token (it predicts the first completion token)")
    ids, pos, labels = [], [], []
    for p, c in zip(prompts, completions):
        ids += list(p) + list(c)
        pos += list(range(len(p) + len(c)))
        labels += [IGNORE_INDEX] * len(p) + list(c)
    return {"input_ids": torch.tensor([ids]), "position_ids": torch.tensor([pos]), "labels": torch.tensor([labels])}


def pack_completions(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], advantages: Sequence[float],
    objective: GRPOObjective, *, num_sequences: int, num_tokens: int,
    old_logps: Sequence[Sequence[float]] | None = None, ref_logps: Sequence[Sequence[float]] | None = None,
) -> dict[str, torch.Tensor]:
    """One packed row [1, S] of this SP group's completions, ready for `shard_batch`.

    `completions[i]`: the scored tokens of completion i (TRL's completion_mask == 1: up to and
    including EOS); `advantages[i]`: its advantage; `old_logps[i]` / `ref_logps[i]`: per-token
    log-probabilities of those tokens (old policy for num_iterations > 1; reference for
    beta > 0). `num_sequences` / `num_tokens`: completions and completion tokens of the whole
    optimizer step over ALL DP groups. Returns input_ids, position_ids, labels (HF unshifted,
    -100 on the prompt) and the target-aligned float64 rows grpo_weight / grpo_advantage /
    grpo_old_logps / grpo_ref_logps and grpo_doc (completion index + 1; 0 = no target).
    """
    n = len(prompts)
    if n == 0 or len(completions) != n or len(advantages) != n:
        raise ValueError(f"prompts, completions and advantages need one entry per completion, got {n}, "
                         f"{len(completions)}, {len(advantages)}")
    lengths = [len(c) for c in completions]
    _check_rows("old_logps", old_logps, lengths)
    _check_rows("ref_logps", ref_logps, lengths)
    weights = objective.weights(lengths, num_sequences, num_tokens)
    out = pack_rows(prompts, completions)
    rows = {k: [] for k in _KEYS}
    for i, (p, c) in enumerate(zip(prompts, completions)):
        # Target-aligned: position j predicts token j + 1; completion token t sits at len(p) + t.
        scored = [0.0] * (len(p) - 1) + [1.0] * len(c) + [0.0]
        rows["grpo_weight"] += [w * weights[i] for w in scored]
        rows["grpo_advantage"] += [float(advantages[i]) * w for w in scored]
        rows["grpo_doc"] += [(i + 1) * w for w in scored]
        for key, src in (("grpo_old_logps", old_logps), ("grpo_ref_logps", ref_logps)):
            if src is not None:
                rows[key] += [0.0] * (len(p) - 1) + [float(v) for v in src[i]] + [0.0]
    for key, values in rows.items():
        if values:
            out[key] = torch.tensor([values], dtype=torch.float64)  # [1, S]
    return out


def shard_completions(packed: dict[str, torch.Tensor], mesh, *, pad_token_id: int = 0) -> dict[str, Any]:
    """`shard_batch` of a `pack_completions` row: this rank's tokens of every row."""
    return shard_batch(packed, mesh, pad_token_id=pad_token_id)


@torch.no_grad()
def add_ref_logps(ref_model: torch.nn.Module, shard: dict[str, Any], objective: GRPOObjective) -> dict[str, Any]:
    """Write the reference model's per-token log-probabilities into `shard` (target-aligned, this
    rank's tokens only: the reference forward runs on the same shard under the same SP mesh)."""
    logps, _, _ = shard_token_logps(ref_model, shard, objective.temperature)  # [B, S_local]
    shard["grpo_ref_logps"] = logps.double()
    return shard


def shard_token_logps(model: torch.nn.Module, shard: dict[str, Any],
                      temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """`model`'s forward on this rank's `shard`: the fp32 log-probability of each target
    (`shift_labels`) and the entropy (no gradient), of logits / temperature, [B, S_local] each
    (positions without a target hold garbage: mask them), and the dtype a loss over them is
    returned in (the LM head weight's, at least fp32). Through the chunked LM head
    (`integrations/logprob_head.token_logprobs`): never a [S_local, V] tensor. The one per-token
    log-prob path of the GRPO policy and reference, and of RLOO's loss and scoring."""
    shard = {k: v for k, v in shard.items() if k in _MODEL_KEYS}
    logps, stats = token_logprobs(model, shard, temperature=temperature, stats=("entropy",))
    return logps, stats[..., 0], _loss_dtype(model)


def grpo_loss(model: torch.nn.Module, shard: dict[str, Any], objective: GRPOObjective, mesh,
              num_sequences: int) -> tuple[torch.Tensor, dict[str, float]]:
    """This rank's share of TRL's GRPO loss on its shard, and TRL's logged metrics, global.

    Returns (loss, metrics): `loss` [] differentiable (sum it over ranks for the step loss;
    its gradients sum to the single-process gradient); `metrics`: TRL's names (kl when
    beta != 0, entropy, clip_ratio/{low,high,region}_mean, clip_ratio/low_min, high_max),
    identical on every rank. `num_sequences`: at least the number of completions of any
    packed row (the global N of the step is fine). A collective over the world: every rank
    calls it once per micro-batch."""
    extra = {k: shard[k] for k in _KEYS if k in shard}
    if objective.beta != 0.0 and "grpo_ref_logps" not in extra:  # the same keys on every rank: all raise, before any collective
        raise ValueError(f"beta={objective.beta} needs the reference log-probabilities: pass ref_logps to "
                         "pack_completions or call add_ref_logps(ref_model, shard, objective) on the shard")
    targets = shard["shift_labels"]  # [B, S_local]
    logps, entropy, loss_dtype = shard_token_logps(model, shard, objective.temperature)  # [B, S_local] each
    mask = (targets != IGNORE_INDEX).to(torch.float64)  # [B, S_local]
    lp = logps.double()
    old = extra["grpo_old_logps"] if "grpo_old_logps" in extra else lp.detach()
    adv = extra["grpo_advantage"]
    coef_1 = torch.exp(lp - old)
    coef_2 = torch.clamp(coef_1, 1 - objective.epsilon_low, 1 + objective.epsilon_high)
    coef_1c = torch.clamp(coef_1, max=objective.delta) if objective.delta is not None else coef_1
    per_token = -torch.min(coef_1c * adv, coef_2 * adv)
    kl = None
    if objective.beta != 0.0:
        ref = extra["grpo_ref_logps"]
        kl = torch.exp(ref - lp) - (ref - lp) - 1
        if objective.use_bias_correction_kl:  # TRL: per_token_kl * coef_1 (before the delta clamp)
            kl = kl * coef_1
        per_token = per_token + objective.beta * kl
    loss = (per_token * mask * extra["grpo_weight"]).sum()
    # TRL reassigns coef_1 to its delta-clamped value before these metrics
    low = ((coef_1c < 1 - objective.epsilon_low) & (adv < 0)).double().detach()
    high = ((coef_1c > 1 + objective.epsilon_high) & (adv > 0)).double().detach()
    metrics = _metric_sums(mask, entropy.double(), kl, low, high, extra["grpo_doc"], num_sequences, mesh)
    return loss.to(loss_dtype), metrics  # fp32 (fp64 models: fp64), never bf16


def _loss_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the loss is returned in: the LM head weight's, at least fp32."""
    return torch.promote_types(hf_model(model).get_output_embeddings().weight.dtype, torch.float32)


def _metric_sums(mask, entropy, kl, low, high, doc, num_sequences: int, mesh) -> dict[str, float]:
    """TRL's logged metrics of this micro-batch as global values (see the module docstring)."""
    names = ["entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
    values = [entropy, low, high, torch.maximum(low, high)]
    if kl is not None:
        names, values = ["kl"] + names, [kl.detach()] + values
    totals = torch.stack([(v * mask).sum() for v in values] + [mask.sum()])  # [M + 1]: Σ value·mask, Σ mask
    # Per-completion [low, high, count] sums; row 0 collects the positions without a target.
    per_doc = torch.zeros(num_sequences + 1, 3, dtype=torch.float64, device=mask.device)  # [N + 1, 3]
    idx = doc.long().reshape(-1)  # [B·S_local]
    per_doc.index_add_(0, idx, torch.stack([(low * mask).reshape(-1), (high * mask).reshape(-1), mask.reshape(-1)], -1))
    if mesh.world_size > 1:
        dist.all_reduce(totals, group=mesh.world_mesh.get_group())  # [M + 1]: Σ over every rank
        if mesh.sp > 1:
            dist.all_reduce(per_doc, group=mesh.sp_group)  # [N + 1, 3]: a completion's tokens are spread over its SP group
    count = per_doc[1:, 2]  # [N]; 0 for rows past this DP group's completions
    seq_low = torch.where(count > 0, per_doc[1:, 0] / count.clamp_min(1), torch.full_like(count, float("inf")))
    seq_high = torch.where(count > 0, per_doc[1:, 1] / count.clamp_min(1), torch.full_like(count, float("-inf")))
    ext = torch.stack([seq_low.min(), -seq_high.max()])  # [2]: both as minima, one MIN all-reduce
    if mesh.world_size > 1:
        dist.all_reduce(ext, op=dist.ReduceOp.MIN, group=mesh.world_mesh.get_group())  # [2]: over DP groups
    metrics = {name: float(totals[i] / totals[-1].clamp_min(1.0)) for i, name in enumerate(names)}
    low_min, high_max = float(ext[0]), float(-ext[1])
    metrics["clip_ratio/low_min"] = low_min if low_min != float("inf") else float("nan")  # TRL's nanmin of all-nan
    metrics["clip_ratio/high_max"] = high_max if high_max != float("-inf") else float("nan")
    return metrics
