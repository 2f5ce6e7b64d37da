"""One optimizer step of the Trainer path: forward/backward over the step's micro-batches,
the loss each rank reports, the token statistics TRL logs and the gradient norm.

Where it sits: `LongContextTrainerMixin.training_step` / `compute_loss` / `_clip_grad_norm`
(`training/sft/trainer.py`) delegate here; the Trainer's own loop then clips, steps the optimizer
and the scheduler. The contract (DESIGN invariant 6): each micro-batch's loss is this rank's
token-loss sum / the step's GLOBAL target count; gradients are summed over micro-batches
(FSDP2 reduce-scatters once, after the last backward, unless `sync_each_microbatch`) and
over ranks; the logged loss is the step's `global_loss`.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Any

import torch

from hf_longctx.data.sharding import SP_METADATA_KEY
from hf_longctx.distributed.flex.unsharded_step import check_unsharded_step, unsharded_step
from hf_longctx.loss import global_loss
from hf_longctx.training.base.faults import comm_guard
from hf_longctx.training.base.step_record import StepRecord


def run_step(trainer: Any, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    """The body of `training_step`: every micro-batch of the step dict, then the step's global loss."""
    if "micro_batches" not in inputs:
        raise ValueError("LongContextTrainer.training_step expects the step dicts of its own train dataloader")
    model.train()
    trainer._window.start_step()
    step = trainer.state.global_step + 1
    micro_batches = inputs["micro_batches"]
    fsdp = hasattr(model, "set_requires_gradient_sync")
    local = torch.zeros((), dtype=torch.float64, device=trainer.args.device)  # Σ this rank's micro-batch losses
    times: list[float] = []
    unsharded = fsdp and not inputs.get("equal_calls", True)
    watchdog = trainer.watchdog
    with comm_guard(step, watchdog.timeout_s if watchdog else None), ExitStack() as stack:
        if unsharded:  # unequal counts: gather once, sync in this rank's own last backward
            if not trainer._unsharded_checked:  # the bytes it needs do not change during the run
                check_unsharded_step(model, trainer.world_mesh.world_mesh.get_group())
                trainer._unsharded_checked = True
            before_backward = stack.enter_context(unsharded_step(model, len(micro_batches)))
        for i, mb in enumerate(micro_batches):
            t0 = time.perf_counter()
            if fsdp and not unsharded:  # FSDP2: accumulate unsharded, reduce-scatter (a SUM) once, after the last micro-batch
                model.set_requires_gradient_sync(trainer.sync_each_microbatch or i == len(micro_batches) - 1)
            mb = trainer._prepare_inputs(mb)
            with trainer.compute_loss_context_manager():
                loss = trainer.compute_loss(model, mb, num_items_in_batch=mb["num_items_in_batch"])
            if unsharded:
                before_backward(i)
            trainer.accelerator.backward(loss)
            local += loss.detach().double()
            times.append(time.perf_counter() - t0)
            if watchdog is not None:
                watchdog.beat(step)
        step_loss = global_loss(local, trainer.world_mesh)  # []: the step's global token mean, on every rank
        every = trainer.args.torch_empty_cache_steps
        if every is not None and trainer.state.global_step % every == 0:  # as Trainer.training_step does
            from accelerate.utils import clear_device_cache

            clear_device_cache()
        flush_token_stats(trainer, "train", inputs["tokens"])
    trainer.last_plan = StepRecord(step, inputs.get("plan"), inputs.get("lengths", ()), inputs.get("plan_stats") or {},
                                   tuple(times))
    trainer._window.end_step(loss=float(step_loss), tokens=inputs["tokens"], flops=inputs["flops"],
                             balance=inputs["balance"], layouts=inputs.get("layouts"), busy=inputs.get("busy"))
    return step_loss.to(torch.float32)


def model_loss(trainer: Any, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool) -> Any:
    """The body of `compute_loss`: the model's loss IS this rank's share (local sum / global
    count), with no num_processes factor. TRL's fused LM head is not used (we never pass
    fused_lm_head=True): the model's own head and loss run, chunked when patched with loss_chunks=N."""
    if SP_METADATA_KEY not in inputs:
        raise ValueError("compute_loss needs a shard from the trainer's step dataloader (shard_batch metadata missing)")
    outputs = model(**inputs)
    loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
    if trainer._token_stats is not None:
        trainer._token_stats.add(outputs.get("logits") if isinstance(outputs, dict) else None, inputs["shift_labels"])
    return (loss, outputs) if return_outputs else loss


def flush_token_stats(trainer: Any, mode: str, tokens: int | None) -> None:
    """TRL's entropy / mean_token_accuracy / num_tokens metrics, as global values."""
    if trainer._token_stats is None:
        return
    stats = trainer._token_stats.flush(trainer.args.device)
    if stats is not None:
        trainer._metrics[mode]["entropy"].append(stats[0])
        trainer._metrics[mode]["mean_token_accuracy"].append(stats[1])
    if mode == "train" and tokens is not None:
        trainer._total_train_tokens += tokens  # trained tokens of the whole step, once (not per rank)
        trainer._metrics[mode]["num_tokens"] = [trainer._total_train_tokens]


def grad_norm(model: torch.nn.Module, max_norm: float, step: int) -> torch.Tensor:
    """torch's clip_grad_norm_ on the (DTensor) gradients: the norm of the whole summed gradient."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    with comm_guard(step):
        # DTensor gradients: torch reduces the norm over their mesh, i.e. the norm of the whole summed gradient.
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm
