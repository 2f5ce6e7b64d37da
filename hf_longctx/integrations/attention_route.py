"""What a checkpoint mode does with the attention calls of the layers it wraps: the one object
the registered attention asks.

Where it sits: `PatchState.route` is the patch's route -- the `AttentionKeeper` of
checkpoint="attention" (`checkpoint_attention.py`: the forward keeps each attention's output and
saved tensors, the recompute replays them), the `LayerSplit` of checkpoint=True
(`layer_split.py`: memory="max" runs a layer's row chunks up to their attention call and after
it with the answer given), or None without checkpointing. `integrations/attention.sp_attention`
reads it once per call: `answer` first (an output without the kernel), else `run`. FPDT §3.3-3.5
and §4 (what a checkpointed long-context layer does with its attention)."""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch


@runtime_checkable
class AttentionRoute(Protocol):
    """The attention side of a checkpoint mode (see the module docstring)."""

    def answer(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
        """This call's output [B, S_local, H, D_v] without running the attention (a replay), or
        None: the attention runs (`run`). query [B, H, S_local, D], key/value [B, H_kv, S_local, D]."""

    def run(self, attend: Callable[[bool], torch.Tensor], prepared: Callable[[], tuple]) -> torch.Tensor:
        """The call's output: `attend(save)` runs the SP attention (save: whether it keeps
        tensors for a backward); `prepared()` gives its (q, k, v, AttentionCall) without running it."""
