"""The one training loop every recipe shares.

Where it sits: on top of the whole data flow of DESIGN.md. Per step, every rank
1. draws the SAME global list of documents from the `StepSampler` (no communication),
2. hands it to `LongContextCollator`, which plans DP ranks × micro-batches by cost
   (Hydraulis / FlexSP) and returns THIS rank's sharded micro-batches,
3. runs forward/backward on each micro-batch of the patched model (USP / FPDT attention),
   with FSDP's gradient reduce-scatter only on the LAST one (`set_requires_gradient_sync`),
4. steps AdamW and the cosine schedule. The micro-batch count varies per step, which is why
   this is not Accelerate's fixed `gradient_accumulation_steps` -- that would also divide
   the loss by the count, while here every micro-batch loss is already normalised by the
   step's GLOBAL target count and the gradients are SUMMED (invariant 6; FSDP2 plan of
   `integrations/accelerate.py`: ZeRO-3 over DP × SP, USP "Tip 3").
Checkpoints (`checkpoint.py`), progress (`progress.py`) and fault handling (`faults.py`)
wrap around it. The process group (and its timeout) belongs to the caller: a recipe creates
an `Accelerator`, the tests use their own gloo ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal, Sequence

import torch

from hf_longctx.data.collator import LongContextCollator
from hf_longctx.data.cost import CostModel
from hf_longctx.data.sampler import StepSampler
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.integrations.accelerate import fsdp_plan
from hf_longctx.integrations.transformers import is_patched, patch
from hf_longctx.loss import global_loss
from hf_longctx.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from hf_longctx.training.faults import Watchdog, comm_guard
from hf_longctx.training.progress import Progress
from hf_longctx.training.schedule import cosine_schedule


@dataclass(frozen=True)
class TrainConfig:
    """Everything the loop needs besides model, data and mesh.

    steps: optimizer steps of the schedule. tokens_per_step: global token budget of one step
    (the sampler's). max_tokens: tokens of one micro-batch of one SP group, padding included.
    stop_after: stop after this many steps although the schedule spans `steps` (a planned
    interruption; resume with the same config). save_every: checkpoint period in steps (0:
    only at the end, if output_dir is set). resume: continue from the newest checkpoint in
    output_dir. step_timeout_s: Watchdog period (None: rely on the process-group timeout).
    """

    steps: int
    tokens_per_step: int
    max_tokens: int
    lr: float = 1e-3
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float | None = 1.0
    seed: int = 0
    strategy: str = "balanced"
    overlong: str = "split"
    mixed_precision: Literal["bf16", "fp32"] = "bf16"
    param_offload: bool = False
    output_dir: str | None = None
    save_every: int = 0
    resume: bool = True
    stop_after: int | None = None
    step_timeout_s: float | None = None
    peak_flops: float | None = None  # per device; None: datasheet value on known GPUs
    log_every: int = 1
    progress_bar: bool = True

    def __post_init__(self) -> None:
        for name in ("steps", "tokens_per_step", "max_tokens", "log_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.save_every < 0 or (self.save_every and not self.output_dir):
            raise ValueError(f"save_every={self.save_every} needs save_every >= 0 and an output_dir (got {self.output_dir!r})")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise ValueError(f"stop_after={self.stop_after} must lie in [1, steps={self.steps}]")


@dataclass
class StepRecord:
    step: int
    loss: float
    tokens: int
    seconds: float
    tokens_per_s: float
    mfu: float | None
    peak_mem_gib: float
    balance: float | None
    lr: float
    microbatches: int


@dataclass
class TrainResult:
    records: list[StepRecord] = field(default_factory=list)
    start_step: int = 0
    wall_s: float = 0.0
    checkpoint: str | None = None

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.records]

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.records)


def _step_stream(sampler: StepSampler) -> Iterator[list[int]]:
    while True:
        empty = True
        for indices in sampler:
            empty = False
            yield indices
        if empty:
            raise ValueError("the step sampler yields no step: the dataset is empty (or drop_last left nothing)")


def _to_device(mb: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}


def _clip(params: list[torch.nn.Parameter], max_norm: float) -> None:
    # clip_grad_norm_ reduces DTensor (FSDP2) gradient norms over the mesh itself.
    grads = [p for p in params if p.grad is not None]
    if grads:
        torch.nn.utils.clip_grad_norm_(grads, max_norm)


def train(
    model: torch.nn.Module,
    dataset: Any,
    mesh: SPMesh,
    config: TrainConfig,
    *,
    cost: CostModel | None = None,
    pad_token_id: int = 0,
    device: torch.device | None = None,
    patch_options: dict[str, Any] | None = None,
    callbacks: Sequence[Callable[[StepRecord], None]] = (),
) -> TrainResult:
    """Train `model` (an HF causal LM, patched here if it is not yet) on `dataset` (rows with
    `input_ids` and `length`, e.g. from `tokenize_dataset`) over `mesh`. Call on every rank.

    The model is sharded with `fsdp_plan(...).apply` (ZeRO-3 over the whole world); the
    cost model defaults to `CostModel.from_config(model.config)` (FLOPs, also used for MFU).
    `callbacks` get every step's record on every rank.
    """
    if not isinstance(mesh, SPMesh):
        raise TypeError(f"mesh must be an SPMesh from init_sequence_parallel, got {type(mesh).__name__}")
    if "length" not in dataset.column_names or "input_ids" not in dataset.column_names:
        raise ValueError(f"dataset needs 'input_ids' and 'length' columns (tokenize_dataset), has {dataset.column_names}")
    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    hf_config = getattr(model, "config", None)
    flops_model = CostModel.from_config(hf_config) if hf_config is not None else None
    cost = cost or flops_model
    if not is_patched(model):
        patch(model, mesh, **(patch_options or {}))
    fsdp_plan(model, mesh, mixed_precision=config.mixed_precision, param_offload=config.param_offload).apply(model)
    # One process: there is nothing to shard, so the FSDP plan leaves the model alone. Move it
    # ourselves and take bf16 from autocast (FSDP's mixed-precision policy is absent).
    single = not hasattr(model, "set_requires_gradient_sync")
    if single:
        if config.param_offload:
            raise ValueError("param_offload=True needs FSDP (world size > 1); in one process use kv_offload / checkpoint")
        model.to(device)
    autocast = dict(device_type=device.type, dtype=torch.bfloat16, enabled=single and config.mixed_precision == "bf16")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    scheduler = cosine_schedule(optimizer, config.steps, warmup_steps=config.warmup_steps, min_ratio=config.min_lr_ratio)
    lengths = [int(n) for n in dataset["length"]]
    sampler = StepSampler(lengths, tokens_per_step=config.tokens_per_step, seed=config.seed)
    collator = LongContextCollator(
        mesh, config.max_tokens, cost, strategy=config.strategy, overlong=config.overlong, seed=config.seed,
        pad_token_id=pad_token_id,
    )

    result = TrainResult()
    resume_from = latest_checkpoint(config.output_dir) if config.resume else None
    if resume_from is not None:
        result.start_step = load_checkpoint(resume_from, model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler)
    sync = not single  # FSDP: reduce-scatter only on the last micro-batch
    end = config.stop_after or config.steps
    progress = Progress(
        config.steps, initial=result.start_step, world_size=mesh.world_size, device=device, peak_flops=config.peak_flops,
        enabled=mesh.rank == 0, bar=config.progress_bar,
    )
    if resume_from is not None:
        progress.write(f"resumed from {resume_from} after step {result.start_step}")
    watchdog = Watchdog(config.step_timeout_s) if config.step_timeout_s else None
    stream = _step_stream(sampler)
    t_start = time.perf_counter()
    try:
        if watchdog is not None:
            watchdog.__enter__()
        for step in range(result.start_step + 1, end + 1):
            t0 = time.perf_counter()
            indices = next(stream)
            rows = dataset[indices]
            # labels (HF unshifted convention) when the dataset has them, else the collator uses input_ids
            keys = [k for k in ("input_ids", "labels") if k in rows]
            features = [dict(zip(keys, values)) for values in zip(*(rows[k] for k in keys))]
            with comm_guard(step, config.step_timeout_s):
                mbs = collator(features)
                local = torch.zeros((), dtype=torch.float64)
                for i, mb in enumerate(mbs):
                    if sync:
                        model.set_requires_gradient_sync(i == len(mbs) - 1)
                    with torch.autocast(**autocast):
                        out = model(**_to_device(mb, device))
                    out.loss.backward()
                    local += out.loss.detach().double().cpu()
                    if watchdog is not None:
                        watchdog.beat(step)
                if config.grad_clip:
                    _clip(params, config.grad_clip)
                lr = scheduler.get_last_lr()[0]
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                loss = float(global_loss(local.to(device), mesh))
            seconds = time.perf_counter() - t0
            # What was trained: the plan's pieces (split documents attend within a piece,
            # truncated tails are not trained), not the original documents.
            plan = collator.last_plan
            step_lengths = [p.end - p.start for p in plan.pieces] if plan is not None else [lengths[i] for i in indices]
            tokens = int(sum(step_lengths))
            flops = float(flops_model(step_lengths).sum()) if flops_model is not None else 0.0
            stats = collator.stats or {}
            if step % config.log_every == 0 or step == end:
                rec = progress.update(step, loss=loss, tokens=tokens, seconds=seconds, flops=flops,
                                      balance=stats.get("synced_over_ideal"), lr=lr)
            else:
                rec = {"step": step, "loss": loss, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                       "mfu": None, "peak_mem_gib": 0.0, "balance": stats.get("synced_over_ideal"), "lr": lr}
            record = StepRecord(**rec, microbatches=len(mbs))
            result.records.append(record)
            for cb in callbacks:
                cb(record)
            periodic = config.save_every and step % config.save_every == 0
            if config.output_dir and (periodic or step == end):
                with comm_guard(step, config.step_timeout_s):
                    result.checkpoint = save_checkpoint(
                        config.output_dir, step, model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler
                    )
                if watchdog is not None:
                    watchdog.beat(step)
    finally:
        if watchdog is not None:
            watchdog.__exit__(None, None, None)
        progress.close()
    result.wall_s = time.perf_counter() - t_start
    return result
