"""One optimizer step of the Trainer path: forward/backward over the step's micro-batches, the
loss each rank reports, and the gradient norm.

Where it sits: every trainer's `training_step` runs `StepLoop.run` through
`SPTrainerBase._run_step` (`base/trainer.py`) with what the step needs passed in (the
micro-batch loss, the backward, the device); the Trainer's own loop then clips (`grad_norm`), steps the optimizer and the
scheduler. The contract (DESIGN invariant 6): each micro-batch's loss is this rank's
token-loss sum / the step's GLOBAL target count; gradients are summed over micro-batches
(FSDP2 reduce-scatters once, after the last backward, unless `sync_each_microbatch`) and over
ranks; the logged loss is the step's `global_loss`.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Any, Callable

import torch

from hf_longctx.data.sharding import SP_METADATA_KEY
from hf_longctx.flex.unsharded_step import check_unsharded_step, unsharded_step
from hf_longctx.distributed.loss import global_loss
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.training.base.faults import comm_guard
from hf_longctx.training.base.metrics import StepWindow
from hf_longctx.training.base.step_data import StepBatch
from hf_longctx.training.base.step_record import StepRecord


class StepLoop:
    """The loop over one step's micro-batches, and what it keeps between steps: the logging
    window, the last step's `StepRecord`, whether the unsharded step's memory was checked.

    `world_mesh`: the whole DP x SP world (the loss all-reduce); `window`: the `StepWindow`
    the trainer's `log` drains (None: the trainer logs its own figures); `watchdog`: beaten after every micro-batch (None: none);
    `sync_each_microbatch`: reduce-scatter in every backward instead of the last only.
    """

    def __init__(self, world_mesh: SPMesh, window: StepWindow | None, watchdog: Any = None, *,
                 sync_each_microbatch: bool = False) -> None:
        self.world_mesh = world_mesh
        self.window = window
        self.watchdog = watchdog
        self.sync_each_microbatch = sync_each_microbatch
        self.last_record: StepRecord | None = None
        self._unsharded_checked = False  # the bytes the unsharded step needs do not change during the run

    def run(self, model: torch.nn.Module, batch: StepBatch, *, step: int, micro_loss: Callable[[dict], torch.Tensor],
            backward: Callable[[torch.Tensor], None], device: torch.device) -> torch.Tensor:
        """Every micro-batch of `batch` (`micro_loss(mb)`: this rank's share, `backward(loss)`),
        then the step's global loss on every rank. `step`: the optimizer step being run (1-based)."""
        if not isinstance(batch, StepBatch):
            raise ValueError("LongContextTrainer.training_step expects the StepBatch items of its own train dataloader")
        if self.window is not None:
            self.window.start_step()
        micro_batches = batch.micro_batches
        fsdp = hasattr(model, "set_requires_gradient_sync")
        local = torch.zeros((), dtype=torch.float64, device=device)  # Σ this rank's micro-batch losses
        times: list[float] = []
        unsharded = fsdp and not batch.equal_calls
        watchdog = self.watchdog
        with comm_guard(step, watchdog.timeout_s if watchdog else None), ExitStack() as stack:
            if unsharded:  # unequal counts: gather once, sync in this rank's own last backward
                if not self._unsharded_checked:
                    check_unsharded_step(model, self.world_mesh.world_mesh.get_group())
                    self._unsharded_checked = True
                before_backward = stack.enter_context(unsharded_step(model, len(micro_batches)))
            for i, mb in enumerate(micro_batches):
                t0 = time.perf_counter()
                if fsdp and not unsharded:  # FSDP2: accumulate unsharded, reduce-scatter (a SUM) once, after the last
                    model.set_requires_gradient_sync(self.sync_each_microbatch or i == len(micro_batches) - 1)
                loss = micro_loss(mb)
                if unsharded:
                    before_backward(i)
                backward(loss)
                local += loss.detach().double()
                times.append(time.perf_counter() - t0)
                if watchdog is not None:
                    watchdog.beat(step)
            step_loss = global_loss(local, self.world_mesh)  # []: the step's global token mean, on every rank
        self.last_record = StepRecord(step, batch.plan, batch.lengths, batch.plan_stats, tuple(times))
        if self.window is not None:
            self.window.end_step(loss=float(step_loss), tokens=batch.tokens, flops=batch.flops, balance=batch.balance,
                                 layouts=batch.layouts, busy=batch.busy)
        return step_loss.to(torch.float32)


def model_loss(model: torch.nn.Module, inputs: dict[str, Any], token_stats: Any, return_outputs: bool) -> Any:
    """The body of `compute_loss`: the model's loss IS this rank's share (local sum / global
    count), with no num_processes factor. TRL's fused LM head is not used (we never pass
    fused_lm_head=True): the model's own head and loss run, chunked when patched with
    loss_chunks=N. `token_stats`: a `TokenStats` fed with the logits, or None."""
    if SP_METADATA_KEY not in inputs:
        raise ValueError("compute_loss needs a shard from the trainer's step dataloader (shard_batch metadata missing)")
    outputs = model(**inputs)
    loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
    if token_stats is not None:
        token_stats.add(outputs.get("logits") if isinstance(outputs, dict) else None, inputs["shift_labels"])
    return (loss, outputs) if return_outputs else loss


def grad_norm(model: torch.nn.Module, max_norm: float, step: int) -> torch.Tensor:
    """torch's clip_grad_norm_ on the (DTensor) gradients: the norm of the whole summed gradient."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    with comm_guard(step):
        # DTensor gradients: torch reduces the norm over their mesh, i.e. the norm of the whole summed gradient.
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm
