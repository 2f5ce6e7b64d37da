"""A GRPO step computed by hand in one process, with TRL 1.16's `_compute_loss` formulas.

`make_rollouts` draws prompts, completions, advantages and the noise that makes injected
old-policy and reference log-probabilities differ from the current policy (so both clipping
sides fire); `injected` turns them into those log-probabilities; `reference_step` runs the
unpatched model on each prompt+completion alone, pads the completions to [N, L] and returns
the loss, every parameter gradient and TRL's logged metrics (entropy, clip ratios, kl).
EPS_LOW / EPS_HIGH / TEMPERATURE / MAX_LEN are the GRPO settings the step uses. The
reference of tests/distributed/test_grpo_step.py and test_grpo_bf16.py.
"""

from __future__ import annotations

import torch

EPS_LOW, EPS_HIGH, TEMPERATURE, MAX_LEN = 0.2, 0.28, 0.7, 16


def make_rollouts(n: int = 6, seed: int = 0, vocab: int = 128):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (int(k),), generator=g).tolist() for k in torch.randint(3, 9, (n,), generator=g)]
    completions = [torch.randint(1, vocab, (int(k),), generator=g).tolist() for k in torch.randint(1, 13, (n,), generator=g)]
    advantages = (torch.randn(n, generator=g)).tolist()
    noise = [torch.randn(len(c), generator=g) * 0.3 for c in completions]
    ref_noise = [torch.randn(len(c), generator=g) * 0.5 for c in completions]
    return prompts, completions, advantages, noise, ref_noise


def completion_logps(model, prompts, completions) -> list[torch.Tensor]:
    """Per-token log-probabilities of each completion, one unpadded forward per sequence."""
    out = []
    for p, c in zip(prompts, completions):
        ids = torch.tensor([p + c])
        logits = model(input_ids=ids, use_cache=False).logits[0, len(p) - 1 : -1]  # [C, V]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / TEMPERATURE  # fp32 (fp64 for the truth)
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None]).squeeze(-1))
    return out


def injected(model, rollouts, with_old: bool):
    prompts, completions, _, noise, ref_noise = rollouts
    with torch.no_grad():
        base = completion_logps(model, prompts, completions)
    old = [(b + e).tolist() for b, e in zip(base, noise)] if with_old else None
    ref = [(b + e).tolist() for b, e in zip(base, ref_noise)]
    return old, ref


def reference_step(model, rollouts, loss_type: str, beta: float, with_old: bool, bias_correction: bool,
                   delta: float | None = None, rows=None):
    """TRL 1.16 `_compute_loss` (grpo_trainer.py) on a right-padded [N, L] completion batch; `rows`:
    the injected (old, ref) log-probabilities (default: from `model`)."""
    prompts, completions, advantages, _, _ = rollouts
    old_rows, ref_rows = rows if rows is not None else injected(model, rollouts, with_old)
    width = max(len(c) for c in completions)
    dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)

    def pad(rows):  # [N, L]
        return torch.stack([torch.nn.functional.pad(torch.as_tensor(r, dtype=dtype), (0, width - len(r))) for r in rows])

    model.zero_grad(set_to_none=True)
    per_token_logps = pad(completion_logps(model, prompts, completions))  # [N, L]
    logits_all = []
    for p, c in zip(prompts, completions):
        logits = model(input_ids=torch.tensor([p + c]), use_cache=False).logits[0, len(p) - 1 : -1].to(dtype) / TEMPERATURE
        lp = torch.log_softmax(logits, -1)
        logits_all.append(-(lp.exp() * lp).sum(-1).detach())
    entropies = pad(logits_all)
    mask = pad([[1.0] * len(c) for c in completions])
    adv = torch.tensor(advantages, dtype=dtype)[:, None]
    old = pad(old_rows) if with_old else per_token_logps.detach()
    coef_1 = torch.exp(per_token_logps - old)
    ref = pad(ref_rows)
    per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
    if bias_correction:
        per_token_kl = per_token_kl * coef_1
    coef_2 = torch.clamp(coef_1, 1 - EPS_LOW, 1 + EPS_HIGH)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * MAX_LEN)
    else:  # dapo: num_items_in_batch = all completion tokens (one process, one accumulation step)
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}

    def mean(x):
        return ((x * mask).sum() / mask.sum()).item()

    low = ((coef_1 < 1 - EPS_LOW) & (adv < 0)).float()
    high = ((coef_1 > 1 + EPS_HIGH) & (adv > 0)).float()
    metrics = {"entropy": mean(entropies), "clip_ratio/low_mean": mean(low), "clip_ratio/high_mean": mean(high),
               "clip_ratio/region_mean": mean((low + high).clamp(max=1)),
               "clip_ratio/low_min": ((low * mask).sum(-1) / mask.sum(-1)).min().item(),
               "clip_ratio/high_max": ((high * mask).sum(-1) / mask.sum(-1)).max().item()}
    if beta != 0.0:
        metrics["kl"] = mean(per_token_kl.detach())
    return loss.detach(), grads, metrics, (old_rows, ref_rows)
