"""Learning-rate schedule of the training loop: linear warmup, then cosine decay.

Where it sits: `training/loop.py` wraps the optimizer in the `LambdaLR` built here; its
state (the step count) is saved with every checkpoint so a resumed run continues on the
same curve.
"""

from __future__ import annotations

import math

import torch


class _Cosine:
    """Picklable multiplier (LambdaLR saves the __dict__ of callable objects, not lambdas)."""

    def __init__(self, total_steps: int, warmup_steps: int, min_ratio: float) -> None:
        self.total_steps, self.warmup_steps, self.min_ratio = total_steps, warmup_steps, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def cosine_schedule(
    optimizer: torch.optim.Optimizer, total_steps: int, *, warmup_steps: int = 0, min_ratio: float = 0.1
) -> torch.optim.lr_scheduler.LambdaLR:
    """lr(step) = base · warmup ramp, then base · (min_ratio + (1 - min_ratio) · ½(1 + cos(π·t)))."""
    if total_steps < 1 or warmup_steps < 0 or warmup_steps > total_steps:
        raise ValueError(f"need 0 <= warmup_steps ({warmup_steps}) <= total_steps ({total_steps}) and total_steps >= 1")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio must lie in [0, 1], got {min_ratio}")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _Cosine(total_steps, warmup_steps, min_ratio))
