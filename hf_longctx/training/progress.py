"""Progress report of the training loop: loss, tokens/s, estimated MFU, peak memory, plan balance.

Where it sits: fed by `training/loop.py` once per step with figures every rank already
agrees on (the global loss, the step's global token count and FLOPs from
`CostModel.from_config`, the plan's `synced_over_ideal` from `Plan.stats` -- the
Hydraulis / FlexSP balance objective). Only the main process prints: a tqdm bar with the
figures as postfix, plus one plain line per logged step (readable in CI logs, where a bar
is not).

MFU = step FLOPs / (step seconds · world size · peak FLOP/s of one device). The FLOPs are
the model's matmul and attention work (6·N per token plus causal attention), not what the
hardware executed (recomputation is not counted), as in the PaLM definition.
"""

from __future__ import annotations

import resource
import sys
from typing import Any, TextIO

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


def _fmt_tokens(x: float) -> str:
    return f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


class Progress:
    """tqdm bar + per-step lines on the main process; silent elsewhere."""

    def __init__(
        self,
        total_steps: int,
        *,
        initial: int = 0,
        world_size: int = 1,
        device: torch.device | None = None,
        peak_flops: float | None = None,
        enabled: bool = True,
        bar: bool = True,
        file: TextIO | None = None,
    ) -> None:
        self.world_size = world_size
        self.device = device or torch.device("cpu")
        self.peak_flops = peak_flops if peak_flops is not None else device_peak_flops(self.device)
        self.enabled = enabled
        self.file = file or sys.stdout
        self._bar = None
        if enabled and bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=initial, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)

    def update(
        self, step: int, *, loss: float, tokens: int, seconds: float, flops: float, balance: float | None, lr: float
    ) -> dict[str, Any]:
        """Record one finished step; returns the figures (also on non-main ranks)."""
        tps = tokens / seconds if seconds > 0 else float("nan")
        mfu = flops / (seconds * self.world_size * self.peak_flops) if self.peak_flops and seconds > 0 else None
        mem = peak_memory_bytes(self.device) / 2**30
        rec = {"step": step, "loss": loss, "tokens": tokens, "seconds": seconds, "tokens_per_s": tps, "mfu": mfu,
               "peak_mem_gib": mem, "balance": balance, "lr": lr}
        if not self.enabled:
            return rec
        mfu_s = f"{100 * mfu:.1f}%" if mfu is not None else "n/a"
        bal_s = f"{balance:.3f}" if balance is not None else "n/a"
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=_fmt_tokens(tps), mfu=mfu_s, mem=f"{mem:.2f}G", refresh=False)
            self._bar.update(1)
        line = (
            f"step {step:4d} | loss {loss:.4f} | lr {lr:.2e} | {tokens} tok in {seconds:.2f}s = {_fmt_tokens(tps)} tok/s"
            f" | MFU {mfu_s} | plan synced/ideal {bal_s} | peak mem {mem:.2f} GiB"
        )
        self.write(line)
        return rec

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(line, file=self.file)
        else:
            print(line, file=self.file, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
