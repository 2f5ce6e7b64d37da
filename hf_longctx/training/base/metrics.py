"""What the trainers add to the Trainer's logs: the exact step loss, tokens/s, plan balance,
estimated MFU and peak memory; with a group bank, slot layouts and per-rank busy max/mean.

Where it sits: fed once per optimizer step by the trainer's step with figures every rank
already agrees on (the global loss, the step's tokens and FLOPs, the plan's
`synced_over_ideal`), drained by the `log()` override into `log_history`, the progress bar
and every `report_to` back end. Guarantees: the logged loss is the mean of the global step
losses over the logging window, summed in float64 (never the Trainer's mean over ranks);
MFU = FLOPs / (seconds · world · peak FLOP/s), FLOPs as PaLM defines them (6·N per token
plus causal attention: the strict count of capacity/mfu.py, recompute not counted), logged
only where a peak is known."""

from __future__ import annotations

import resource
import time
from typing import Any

import torch

# Dense bf16 peak FLOP/s of common accelerators (vendor datasheets), matched by name.
_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


def device_peak_flops(device: torch.device) -> float | None:
    """Datasheet bf16 peak of `device`, or None when unknown (CPU: no meaningful figure)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _PEAK_BF16.items() if k in name), None)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: allocated device memory on CUDA, resident set on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class StepWindow:
    """Per-step figures between two Trainer log calls (and over the whole run, for train_loss)."""

    def __init__(self, *, world_size: int, device: torch.device, peak_flops: float | None = None) -> None:
        self.world_size = world_size
        self.device = device
        self.peak_flops = peak_flops if peak_flops is not None else device_peak_flops(device)
        self.run_loss_sum = 0.0  # float64 sums over this train() call
        self.run_steps = 0
        self._reset()

    def _reset(self) -> None:
        self.loss_sum, self.steps, self.tokens, self.flops = 0.0, 0, 0, 0.0
        self.balances: list[float] = []
        self.layouts: list[str] = []  # group bank: each step's slot layouts, e.g. "[4] [2+1+1]"
        self.busy: list[float] = []  # group bank: each step's modelled per-rank busy max/mean
        self.t0: float | None = None

    def start_step(self) -> None:
        """Called at the start of a step: the window's clock starts at its first step, so time
        spent in evaluation or checkpointing between windows is not counted."""
        if self.t0 is None:
            self.t0 = time.perf_counter()

    def end_step(self, *, loss: float, tokens: int, flops: float, balance: float | None, layouts: str | None = None,
                 busy: float | None = None) -> None:
        self.loss_sum += loss
        self.steps += 1
        self.tokens += tokens
        self.flops += flops
        self.run_loss_sum += loss
        self.run_steps += 1
        if balance is not None:
            self.balances.append(balance)
        if layouts is not None:
            self.layouts.append(layouts)
        if busy is not None:
            self.busy.append(busy)

    def drain(self) -> dict[str, float]:
        """The window's log entries (loss = mean step loss); empty if no step ran. Resets the window."""
        if not self.steps:
            return {}
        seconds = time.perf_counter() - self.t0 if self.t0 is not None else float("nan")
        out: dict[str, Any] = {
            "loss": self.loss_sum / self.steps,
            "tokens_per_s": self.tokens / seconds if seconds > 0 else float("nan"),
            "step_tokens": self.tokens / self.steps,
            "peak_mem_gib": peak_memory_bytes(self.device) / 2**30,
        }
        if self.balances:
            out["plan_balance"] = sum(self.balances) / len(self.balances)  # synced / ideal, 1.0 = perfect
        if self.layouts:  # a string: the printer/progress callbacks show it, scalar-only back ends skip it
            out["plan_layouts"] = " ; ".join(self.layouts)
        if self.busy:
            out["plan_busy_max_over_mean"] = sum(self.busy) / len(self.busy)  # 1.0 = every rank equally busy
        if self.peak_flops and seconds > 0:
            out["mfu"] = self.flops / (seconds * self.world_size * self.peak_flops)
        self._reset()
        return out

    @property
    def run_loss(self) -> float | None:
        return self.run_loss_sum / self.run_steps if self.run_steps else None
