"""Evaluation on the Trainer path: Σ token losses / Σ valid targets over the whole eval set,
sharded and planned like training.

Where it sits: `LongContextTrainerMixin.evaluation_loop` (`training/sft/trainer.py`). The stock
loop averages per-batch means (a different number when batches hold different target
counts); here every micro-batch's loss (the step-normalised share) is scaled back to this
rank's token-loss sum, summed over ranks with `global_loss`, and divided by the global count.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from transformers.trainer_utils import EvalLoopOutput

from hf_longctx.distributed.loss import global_loss
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.training.base.faults import comm_guard


def evaluate(model: torch.nn.Module, dataloader: Any, metric_key_prefix: str, *,
             micro_loss: Callable[[dict], torch.Tensor], autocast: Callable[[], Any], world_mesh: SPMesh,
             device: torch.device, step: int, watchdog: Any = None) -> EvalLoopOutput:
    """Every `StepBatch` of `dataloader` under no_grad (`micro_loss(mb)`: a micro-batch's share of
    its step, run under `autocast()`); the loss of the whole set on every rank. `step`: the
    optimizer step evaluated after (a watchdog beat and a fault report name it)."""
    model.eval()
    t0 = time.perf_counter()
    local = torch.zeros((), dtype=torch.float64, device=device)  # Σ this rank's token losses
    targets = tokens = 0
    with torch.no_grad(), comm_guard(step):
        for batch in dataloader:
            n = batch.num_items_in_batch
            for mb in batch.micro_batches:
                with autocast():
                    loss = micro_loss(mb)
                local += loss.double() * n  # undo the step normalisation: this rank's token-loss sum
                if watchdog is not None:  # evaluation is progress too (it runs between steps)
                    watchdog.beat(step)
            targets += n  # the same on every rank
            tokens += batch.tokens
        total = global_loss(local, world_mesh)  # []: Σ over all ranks
    metrics = {
        f"{metric_key_prefix}_loss": float(total) / max(targets, 1),
        f"{metric_key_prefix}_targets": targets,
        f"{metric_key_prefix}_tokens_per_s": tokens / max(time.perf_counter() - t0, 1e-9),
    }
    return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=len(dataloader.dataset))
