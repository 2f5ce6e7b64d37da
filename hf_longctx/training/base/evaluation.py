"""Evaluation on the Trainer path: Σ token losses / Σ valid targets over the whole eval set,
sharded and planned like training.

Where it sits: `LongContextTrainerMixin.evaluation_loop` (`training/sft/trainer.py`). The stock
loop averages per-batch means (a different number when batches hold different target
counts); here every micro-batch's loss (the step-normalised share) is scaled back to this
rank's token-loss sum, summed over ranks with `global_loss`, and divided by the global count.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers.trainer_utils import EvalLoopOutput

from hf_longctx.loss import global_loss
from hf_longctx.training.base.faults import comm_guard
from hf_longctx.training.base.step_loop import flush_token_stats


def evaluate(trainer: Any, dataloader: Any, metric_key_prefix: str) -> EvalLoopOutput:
    model = trainer.model
    model.eval()
    t0 = time.perf_counter()
    local = torch.zeros((), dtype=torch.float64, device=trainer.args.device)  # Σ this rank's token losses
    targets = tokens = 0
    with torch.no_grad(), comm_guard(trainer.state.global_step):
        for step in dataloader:
            n = step["num_items_in_batch"]
            for mb in step["micro_batches"]:
                with trainer.accelerator.autocast():
                    loss = trainer.compute_loss(model, trainer._prepare_inputs(mb))
                local += loss.double() * n  # undo the step normalisation: this rank's token-loss sum
                if trainer.watchdog is not None:  # evaluation is progress too (it runs between steps)
                    trainer.watchdog.beat(trainer.state.global_step)
            targets += n  # the same on every rank
            tokens += step["tokens"]
        total = global_loss(local, trainer.world_mesh)  # []: Σ over all ranks
        flush_token_stats(trainer, "eval", None)
    metrics = {
        f"{metric_key_prefix}_loss": float(total) / max(targets, 1),
        f"{metric_key_prefix}_targets": targets,
        f"{metric_key_prefix}_tokens_per_s": tokens / max(time.perf_counter() - t0, 1e-9),
    }
    return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=len(dataloader.dataset))
