"""DPO objective on a sharded packed batch of preference pairs (issue 21, item 2; DPO paper
eq. 7; TRL `DPOTrainer` formulas for "sigmoid", "hinge" and "ipo").

Where it sits: after `model(**shard)` on a packed row whose documents are pairs laid out
as [chosen_0, rejected_0, chosen_1, rejected_1, ...] (prompt tokens labelled -100, so only
completion targets count, as in TRL). `completion_logps` turns this rank's logits into
per-document sums of target log-probs with `distributed/doc_sums.py` (reduced over the SP
group, identical on every SP rank); `dpo_loss` turns policy and reference sums into this
rank's SHARE of the step loss: the per-pair losses summed, divided by the GLOBAL number of
pairs of the step and by the SP degree (every SP rank computes the same pairs; loss.py sums
the shares and the gradients over ranks). The logged rewards/margins/accuracies are
returned as SUMS over this SP group's pairs so that the caller can all-reduce them over DP
and divide by the global pair count (TRL logs the mean over the gathered pairs).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F

from hf_longctx.distributed.doc_sums import doc_sums, target_mask

LOSS_TYPES = ("sigmoid", "hinge", "ipo")


def completion_logps(logits: torch.Tensor, shard: Mapping[str, Any], mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 [D] summed target log-probs per document, fp32 [D] target counts), every SP rank.

    logits [1, S_local, V] of this rank's shard (packed row, B = 1)."""
    if logits.shape[0] != 1:
        raise ValueError(f"DPO pairs must be packed in one row (B = 1), got logits of shape {tuple(logits.shape)}")
    targets = shard["shift_labels"]  # [1, S_local] pre-shifted, -100 on prompts and padding
    logp = torch.log_softmax(logits.float(), dim=-1)  # [1, S_local, V] fp32
    token = logp.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)  # [1, S_local]
    mask = target_mask(shard)
    sums = doc_sums(token, shard, mesh, mask=mask)[0]  # [D]
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
