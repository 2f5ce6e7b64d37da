"""DPO objective on a sharded packed batch of preference pairs (DPO paper eq. 7; TRL
`DPOTrainer` formulas for "sigmoid", "hinge" and "ipo").

Where it sits: after the forward of a row of pairs [chosen_0, rejected_0, ...] (prompt labels
-100). `completion_sums` turns per-token log-probs (the chunked LM head's,
`integrations/logprob_head.py`; `completion_logps` from full logits) into per-document sums
(`distributed/doc_sums.py`, identical on every SP rank); `dpo_loss` turns policy and
reference sums into this rank's SHARE of the step loss: Σ per-pair losses / (GLOBAL pairs ×
sp), so the shares summed over ranks are TRL's mean. Rewards, margins and accuracies come
back as SUMS over this group's pairs, for the caller to all-reduce over DP."""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F

from hf_longctx.distributed.doc_sums import doc_sums, target_mask
from hf_longctx.training.refusals.dpo import LOSS_TYPES


def completion_logps(logits: torch.Tensor, shard: Mapping[str, Any], mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 [D] summed target log-probs per document, fp32 [D] target counts), every SP rank,
    from the full logits [1, S_local, V] of this rank's shard (packed row, B = 1). The trainer
    takes the chunked path instead (`integrations/logprob_head.token_logprobs` + `completion_sums`)."""
    if logits.shape[0] != 1:
        raise ValueError(f"DPO pairs must be packed in one row (B = 1), got logits of shape {tuple(logits.shape)}")
    targets = shard["shift_labels"]  # [1, S_local] pre-shifted, -100 on prompts and padding
    logp = torch.log_softmax(logits.float(), dim=-1)  # [1, S_local, V] fp32
    token = logp.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)  # [1, S_local]
    return completion_sums(token, shard, mesh)


def completion_sums(token_logps: torch.Tensor, shard: Mapping[str, Any], mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 [D] summed target log-probs per document, fp32 [D] target counts), every SP rank,
    from this rank's per-token log-probs [1, S_local] (3 reductions over the SP group: doc_sums)."""
    if token_logps.dim() != 2 or token_logps.shape[0] != 1:
        raise ValueError(f"DPO pairs must be packed in one row (B = 1), got log-probs of shape {tuple(token_logps.shape)}")
    mask = target_mask(shard)
    sums = doc_sums(token_logps, shard, mesh, mask=mask)[0]  # [D]
    counts = doc_sums(mask.float(), shard, mesh, mask=mask)[0].detach()  # [D]
    return sums, counts


def dpo_loss(
    policy: torch.Tensor,
    reference: torch.Tensor,
    *,
    beta: float,
    loss_type: str,
    global_pairs: int,
    sp: int,
    counts: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(this rank's loss share [], detached metric SUMS over these pairs).

    policy, reference: [2P] per-document log-prob sums, documents alternating chosen/rejected.
    counts: [2P] completion token counts (needed by "ipo", which TRL length-normalises).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not supported; use one of {LOSS_TYPES}")
    if policy.shape != reference.shape or policy.dim() != 1 or policy.numel() % 2:
        raise ValueError(
            f"policy {tuple(policy.shape)} and reference {tuple(reference.shape)} log-probs must be the same even "
            "length [2P] (chosen, rejected alternating) -- plan the two documents of a pair together"
        )
    ratios = policy - reference.to(policy)  # [2P]
    chosen, rejected = ratios[0::2], ratios[1::2]  # [P] each
    delta = chosen - rejected  # [P]
    if loss_type == "sigmoid":
        per_pair = -F.logsigmoid(beta * delta) * (1 - label_smoothing) - F.logsigmoid(-beta * delta) * label_smoothing
    elif loss_type == "hinge":
        per_pair = torch.relu(1 - beta * delta)
    else:  # ipo: TRL divides each score by its completion length before the squared loss
        if counts is None:
            raise ValueError("loss_type='ipo' needs the completion token counts (counts=...)")
        n = counts.to(policy).clamp(min=1.0)
        per_pair = (chosen / n[0::2] - rejected / n[1::2] - 1 / (2 * beta)) ** 2
    loss = per_pair.sum() / (global_pairs * sp)  # []: this rank's share
    c, r = beta * chosen.detach(), beta * rejected.detach()
    metrics = {
        "rewards/chosen": c.sum(),
        "rewards/rejected": r.sum(),
        "rewards/accuracies": (c > r).float().sum(),
        "rewards/margins": (c - r).sum(),
    }
    return loss, metrics


TOKEN_SUMS = ("entropy", "tokens", "logits/chosen", "chosen_tokens", "logits/rejected", "rejected_tokens", "top1/chosen")


TOKEN_STATS = ("entropy", "mean_logit", "is_top1")  # ops/chunked_logprobs statistics token_metric_sums reads


@torch.no_grad()
def token_metric_sums(logits: torch.Tensor, shard: Mapping[str, Any], mesh, chunk: int = 4096) -> torch.Tensor:
    """`stats_metric_sums` from the full logits [1, S_local, V] of this micro-batch; the
    vocabulary-wide terms run in chunks of `chunk` positions (bounded fp32 temporaries)."""
    targets = shard["shift_labels"]  # [1, S_local]
    per_token = torch.zeros(1, logits.shape[1], 3, dtype=torch.float32, device=logits.device)  # [1, S_local, 3]
    for s in range(0, logits.shape[1], chunk):
        x = logits[0, s : s + chunk].float()  # [c, V]
        logp = torch.log_softmax(x, dim=-1)
        per_token[0, s : s + chunk, 0] = -(logp.exp() * logp).sum(-1)  # entropy
        per_token[0, s : s + chunk, 1] = x.mean(-1)  # mean logit over the vocabulary
        per_token[0, s : s + chunk, 2] = (x.argmax(-1) == targets[0, s : s + chunk]).float()  # target is the top-1
    return stats_metric_sums(per_token, shard, mesh)


@torch.no_grad()
def stats_metric_sums(stats: torch.Tensor, shard: Mapping[str, Any], mesh) -> torch.Tensor:
    """fp64 [7] sums behind TRL's token metrics over this micro-batch's completion tokens, every SP
    rank (order `TOKEN_SUMS`), from the per-token statistics [1, S_local, 3] (order `TOKEN_STATS`):
    entropy over all completions; mean-over-vocab logits of chosen / rejected tokens and their
    counts; chosen tokens whose target is the argmax. TRL logs entropy = Σ entropy / Σ tokens,
    logits/chosen = Σ / chosen tokens, mean_token_accuracy = top1 / chosen tokens, each over the
    whole step. 4 reductions over the SP group (doc_sums)."""
    mask = target_mask(shard)
    entropy, mean_logits, top1 = (doc_sums(stats[..., i], shard, mesh, mask=mask)[0].double() for i in range(3))  # [D]
    counts = doc_sums(mask.float(), shard, mesh, mask=mask)[0].double()  # [D]
    return torch.stack([entropy.sum(), counts.sum(), mean_logits[0::2].sum(), counts[0::2].sum(),
                        mean_logits[1::2].sum(), counts[1::2].sum(), top1[0::2].sum()])
