"""`LongContextTrainerMixin` / `LongContextTrainer`: exact sequence-parallel training through
`transformers.Trainer` (and any subclass, TRL's `SFTTrainer` included).

Where it sits: on top of the whole data flow of DESIGN.md, in place of a hand-written loop.
Per optimizer step the Trainer's own loop calls `training_step` once with the step dict of
`steps.py` (same global documents on every rank → cost-balanced plan → this rank's sharded
micro-batches); it runs forward/backward on each micro-batch of the `patch`ed model (USP /
FPDT attention) with FSDP's reduce-scatter only on the last, then the Trainer clips, steps
the optimizer and the scheduler, logs, evaluates and checkpoints as usual.

The contract (DESIGN invariant 6): each rank's loss is its token-loss sum divided by the
step's GLOBAL target count and gradients are SUMMED over micro-batches and ranks, so the
update equals a single-process step on the whole global batch. The stock Trainer breaks it
in five places on this stack; each is one override here:
1. under MULTI_CPU/MULTI_GPU Accelerate wraps the model in DDP (an average; it refuses
   DTensors) -- the mixin applies `fsdp_plan` (FSDP2 over DP × SP, sum reduction) and marks
   the model as owning its placement and gradient reduction, the Trainer's path for models
   sharded at load time, so Accelerate only adds autocast;
2. `compute_loss` multiplies by `num_processes` under `average_tokens_across_devices` --
   ours returns the model's loss as is (no factor: gradients are summed, not averaged);
3. it logs `nested_gather(tr_loss).mean()` -- `log` puts the step's `global_loss` there;
4. its eval loss averages per-batch means -- `evaluation_loop` returns Σ token losses /
   Σ valid targets over the whole eval set;
5. it saves rank 0's optimizer state only -- every rank writes its shards (`checkpoint.py`).
`grad_norm` and clipping use torch's `clip_grad_norm_` on the (DTensor) gradients: the norm
of the true, summed gradient.

Flexible SP groups (FlexSP / Hydraulis): `mesh=` a `GroupBank` (`init_group_bank`) and
`max_tokens_per_rank=` instead of `max_tokens`. The model is `patch(model, bank)`ed, FSDP2
shards it over `bank.world`, and the step DataLoader's collator is a `FlexCollator`: each
step's global list is planned with `plan_flexible` (a group of size s packs at most
s × max_tokens_per_rank), every rank gets the same number of slots, the plan fingerprint is
compared across ranks, and each slot's shard carries its group -- so `training_step` runs
unchanged; the loss contract does not depend on the grouping. The logs add each step's
slot layouts (`plan_layouts`) and the plan's per-rank busy max/mean. `unequal_calls=True`
plans training steps with `plan_unequal` instead: ranks run different numbers of
micro-batches, with the model unsharded for the step (`distributed/flex/unsharded_step.py`:
gathered once, gradients reduce-scattered in each rank's own last backward; refused with
parameter offload or when it does not fit device memory). Evaluation keeps equal counts
(its forwards gather parameters per layer).
"""

from __future__ import annotations

import inspect
import os
import time
from contextlib import ExitStack, nullcontext
from typing import Any

import torch
import transformers
from transformers import Trainer
from transformers.trainer_utils import EvalLoopOutput

from hf_longctx._compat import TRAINER_SHARDED_MODELS, checkpointing_fields, trainer_takes_sharded_models
from hf_longctx.data.collator import LongContextCollator
from hf_longctx.data.cost import CostModel, GroupCost
from hf_longctx.data.sharding import SP_METADATA_KEY
from hf_longctx.distributed.flex.collator import FlexCollator
from hf_longctx.distributed.flex.bank import GroupBank
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.distributed.flex.unsharded_step import check_unsharded_step, unsharded_step
from hf_longctx.integrations.accelerate import fsdp_plan
from hf_longctx.integrations.transformers import _STATE_ATTR, is_patched
from hf_longctx.model_walk import hf_model
from hf_longctx.loss import global_loss
from hf_longctx.training.checkpoint import load_sharded, save_consolidated, save_sharded
from hf_longctx.training.checks import check_process_group, check_trainer_parameters, check_training_arguments, check_world
from hf_longctx.training.faults import WatchdogCallback, comm_guard
from hf_longctx.training.metrics import StepWindow
from hf_longctx.training.step_record import StepRecord
from hf_longctx.training.steps import check_dataset, check_lengths, check_step_budget, document_lengths, step_dataloader
from hf_longctx.training.token_metrics import TokenStats

SCHEDULER_NAME = "scheduler.pt"  # the Trainer's own file name
_TRAINER_PARAMETERS = tuple(inspect.signature(Trainer.__init__).parameters)[1:]  # positional order, without self


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class LongContextTrainerMixin:
    """Put in front of `transformers.Trainer` or any subclass: `class T(LongContextTrainerMixin, SFTTrainer)`.

    Extra keyword arguments: `mesh` (`init_sequence_parallel`, or a `GroupBank` from
    `init_group_bank` for flexible SP groups; the model must be `patch`ed with it),
    `max_tokens` (tokens of one packed micro-batch of an SP group, before sharding; with a
    bank give `max_tokens_per_rank` instead: a group of size s packs at most s × that),
    `tokens_per_step` (global tokens per optimizer step), optionally `cost` (a `CostModel`;
    default: FLOPs of the model's config; with a bank a `GroupCost`, default
    `GroupCost.from_config`: FLOPs split over each size plus its communication), `strategy`
    (the fixed-degree planner's), `overlong` ("error": refuse documents above max_tokens, or
    with a bank above the largest group's capacity; "split" / "truncate"), `pad_token_id` (default: the
    processing class's pad, else EOS, else 0), `step_timeout_s` (watchdog for hung ranks),
    `peak_flops` (per device, for MFU), `unequal_calls` (with a bank: ranks run different
    numbers of micro-batches, the model unsharded for the step), `sync_each_microbatch`
    (reduce-scatter gradients in every micro-batch's backward, Accelerate's
    `sync_each_batch`: sharded accumulation, 4 B/param less memory, more traffic; default:
    once per step, in the last backward), `param_offload` (FSDP2 CPUOffloadPolicy through
    `fsdp_plan`: sharded parameters, gradients and optimizer states in host memory, the
    optimizer step on the CPU). Everything else is plain `TrainingArguments`.
    """

    def __init__(
        self, *args: Any, mesh: SPMesh | GroupBank, max_tokens: int | None = None, tokens_per_step: int,
        cost: CostModel | GroupCost | None = None, strategy: str = "balanced", overlong: str = "error",
        pad_token_id: int | None = None, step_timeout_s: float | None = None, peak_flops: float | None = None,
        max_tokens_per_rank: int | None = None, unequal_calls: bool = False, sync_each_microbatch: bool = False,
        param_offload: bool = False, **kwargs: Any,
    ) -> None:
        if not isinstance(mesh, (SPMesh, GroupBank)):
            raise TypeError(
                "mesh must be an SPMesh from hf_longctx.init_sequence_parallel or a GroupBank from "
                f"hf_longctx.init_group_bank, got {type(mesh).__name__}"
            )
        self.mesh = mesh
        self._check_caps(mesh, max_tokens, max_tokens_per_rank, cost, strategy)
        _flag("unequal_calls", unequal_calls)
        if unequal_calls and not isinstance(mesh, GroupBank):
            raise ValueError(
                "unequal_calls=True needs a GroupBank (flexible SP groups planned by plan_unequal); with an SPMesh "
                "every rank runs the same number of micro-batches"
            )
        _flag("sync_each_microbatch", sync_each_microbatch)
        if sync_each_microbatch and unequal_calls:
            raise ValueError("sync_each_microbatch=True cannot be combined with unequal_calls=True: with unequal counts "
                             "every rank syncs in its own last backward")
        self.sync_each_microbatch = sync_each_microbatch
        _flag("param_offload", param_offload)
        if param_offload and unequal_calls:
            raise ValueError("param_offload=True cannot be combined with unequal_calls=True: the unequal-count step "
                             "keeps the model unsharded on the device for the whole step; use equal counts")
        self.param_offload = param_offload
        self.last_plan: StepRecord | None = None  # the last step's plan, modelled and measured times
        # Loss all-reduce and FSDP run over the whole world whatever the grouping (DESIGN invariant 6).
        self._world_mesh = mesh.world if isinstance(mesh, GroupBank) else mesh
        self.max_tokens = self._largest_piece(mesh, max_tokens, max_tokens_per_rank)
        self.tokens_per_step = _positive_int("tokens_per_step", tokens_per_step)
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            check_training_arguments(training_args)  # before anything else, on every rank alike
        # Trainer.__init__'s parameters by name (positional ones too), each honoured or refused (arguments.py).
        check_trainer_parameters({**dict(zip(_TRAINER_PARAMETERS, args)), **kwargs})
        model = kwargs.get("model", args[0] if args else None)
        self._check_patched(model)
        self._check_world(mesh)
        # The Trainer writes args.use_cache into model.config; the exported model keeps the user's value.
        self._config_use_cache = getattr(getattr(hf_model(model), "config", None), "use_cache", None)
        if mesh.world_size > 1 and not trainer_takes_sharded_models():  # every rank alike, before any collective
            raise RuntimeError(
                f"LongContextTrainer on {mesh.world_size} ranks needs transformers >= "
                f"{'.'.join(map(str, TRAINER_SHARDED_MODELS))} (its Trainer path for a model sharded before "
                f"prepare); transformers {transformers.__version__} would wrap the FSDP2 model in DDP. Upgrade "
                "transformers, or train on one rank / with hf_longctx.distributed.flex.step.run_flex_step."
            )
        if training_args is not None:
            self._map_activation_checkpointing(model, training_args)
        super().__init__(*args, **kwargs)
        check_training_arguments(self.args)  # the defaults / TRL's SFTConfig conversion
        check_process_group(self.args)
        lengths = None
        if self.train_dataset is not None:
            check_dataset(self.train_dataset)
            lengths = document_lengths(self.train_dataset)
            check_lengths(lengths, self.max_tokens, overlong)
            check_step_budget(lengths, self.tokens_per_step, self.max_tokens, overlong, warn=self.args.process_index == 0)
        self._train_lengths = lengths
        hf_config = getattr(hf_model(self.model), "config", None)
        self._flops_model = CostModel.from_config(hf_config) if hf_config is not None else None
        if isinstance(mesh, GroupBank):
            if cost is None and hf_config is None:
                raise ValueError("with a GroupBank pass cost= (a GroupCost): the model has no config to estimate it from")
            # Default: FLOPs split over each size plus its Ulysses/ring traffic (GroupCost.from_config);
            # without a communication term a bigger group would never cost more and flexibility never pays.
            cost = cost if cost is not None else GroupCost.from_config(hf_config, mesh.shapes)
            self.collator = FlexCollator(mesh, max_tokens_per_rank, cost, overlong=overlong,
                                         pad_token_id=self._pad_id(pad_token_id), unequal_calls=unequal_calls)
            # Evaluation is forward-only under per-layer FSDP all-gathers: always equal counts.
            self.eval_collator = self.collator if not unequal_calls else FlexCollator(
                mesh, max_tokens_per_rank, cost, overlong=overlong, pad_token_id=self._pad_id(pad_token_id))
        else:
            self.collator = LongContextCollator(
                mesh, self.max_tokens, cost if cost is not None else self._flops_model, strategy=strategy, overlong=overlong, seed=self.args.seed,
                pad_token_id=self._pad_id(pad_token_id),
            )
            self.eval_collator = self.collator
        if mesh.world_size > 1:
            self._shard_model()
        self._window = StepWindow(world_size=mesh.world_size, device=self.args.device, peak_flops=peak_flops)
        self._token_stats = TokenStats() if hasattr(self, "_metrics") else None  # TRL's metric store
        self._watchdog = WatchdogCallback(step_timeout_s) if step_timeout_s else None
        if self._watchdog is not None:
            self.add_callback(self._watchdog)
        self._step_sampler = None
        self._unsharded_checked = False

    # ---- set-up ----------------------------------------------------------------------------
    @staticmethod
    def _check_caps(mesh: Any, max_tokens: Any, max_tokens_per_rank: Any, cost: Any, strategy: str) -> None:
        if isinstance(mesh, GroupBank):
            if max_tokens is not None:
                raise ValueError(
                    f"max_tokens={max_tokens!r} with a GroupBank: groups differ in size, so the cap is per rank; pass "
                    "max_tokens_per_rank (a group of size s packs at most s × max_tokens_per_rank tokens)"
                )
            _positive_int("max_tokens_per_rank", max_tokens_per_rank)
            if cost is not None and not isinstance(cost, (GroupCost, CostModel)):
                raise ValueError(f"cost must be a GroupCost (or a CostModel split over the sizes), got {type(cost).__name__}")
            if strategy != "balanced":
                raise ValueError(
                    f"strategy={strategy!r} picks a fixed-degree planner; a GroupBank plans every step with "
                    "plan_flexible (use an SPMesh to run the fixed-degree strategies)"
                )
        else:
            if max_tokens_per_rank is not None:
                raise ValueError("max_tokens_per_rank is the cap of a GroupBank; with an SPMesh pass max_tokens")
            _positive_int("max_tokens", max_tokens)
            if cost is not None and not isinstance(cost, CostModel):
                raise ValueError(f"cost must be a CostModel with an SPMesh, got {type(cost).__name__}")

    @staticmethod
    def _largest_piece(mesh: Any, max_tokens: int | None, max_tokens_per_rank: int | None) -> int:
        """The longest document one micro-batch holds (what `overlong` compares against)."""
        if not isinstance(mesh, GroupBank):
            return max_tokens
        shape = mesh.shape(mesh.max_size)
        return shape.capacity(max_tokens_per_rank) // shape.doc_multiple * shape.doc_multiple

    def _check_patched(self, model: Any) -> None:
        if model is None or isinstance(model, str):
            raise ValueError("pass a model instance patched with hf_longctx.patch(model, mesh), not a name or None")
        if not is_patched(model):
            raise ValueError(
                f"{type(model).__name__} is not patched: call hf_longctx.patch(model, mesh) before building the trainer "
                "(the unpatched model would attend across shards and ranks wrongly)"
            )
        state = hf_model(model).__dict__[_STATE_ATTR]
        if isinstance(self.mesh, GroupBank):
            if state.bank != self.mesh:
                raise ValueError("the model was not patched with the trainer's GroupBank: call patch(model, bank)")
        elif state.bank is not None or state.mesh != self.mesh:
            raise ValueError("the model was patched with a different mesh than the trainer's `mesh`")

    @staticmethod
    def _map_activation_checkpointing(model: Any, args: Any) -> None:
        # HF's checkpointing (TRL's SFTConfig turns it on by default) wraps the decoder layers
        # outside our attention binding; patch(checkpoint=True) recomputes them inside it.
        fields = checkpointing_fields(args)  # no `activation_checkpointing` on transformers 5.17
        if not any(getattr(args, f) for f in fields):
            return
        from hf_longctx.integrations.transformers import patch

        state = hf_model(model).__dict__[_STATE_ATTR]
        if not state.options.checkpoint:  # the preset's knobs stay, checkpointing is added
            knobs = {k: getattr(state.options, k) for k in ("kv_offload", "mlp_chunks", "loss_chunks")}
            patch(model, state.bank or state.mesh, **knobs, checkpoint=True)
        for f in fields:
            setattr(args, f, False)

    @staticmethod
    def _check_world(mesh: Any) -> None:
        check_world(mesh.world.world_size if isinstance(mesh, GroupBank) else mesh.world_size)

    def _pad_id(self, pad_token_id: int | None) -> int:
        if pad_token_id is not None:
            return pad_token_id
        tok = getattr(self.processing_class, "tokenizer", self.processing_class)
        for attr in ("pad_token_id", "eos_token_id"):
            if isinstance(getattr(tok, attr, None), int):
                return getattr(tok, attr)
        return 0

    def _shard_model(self) -> None:
        from torch.distributed.tensor import DTensor

        fsdp_plan(self.model, self._world_mesh, mixed_precision="bf16" if self.args.bf16 else "fp32",
                  param_offload=self.param_offload).apply(self.model)
        loose = [n for n, p in self.model.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
        if loose:
            raise ValueError(f"trainable parameters outside FSDP after fsdp_plan: {loose[:4]}")
        # (1) The Trainer's path for a model that owns placement and gradient reduction:
        # Accelerate prepares autocast only (no DDP, no `.to()` of DTensor shards).
        self.is_distributed_loading_by_transformers = True

    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        if self.mesh.world_size == 1:  # several ranks: fully_shard places the shards
            super()._move_model_to_device(model, device)

    # ---- data --------------------------------------------------------------------------------
    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        if self.train_dataset is None:
            raise ValueError("LongContextTrainer: training requires a train_dataset")
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        loader, self._step_sampler = step_dataloader(
            self.train_dataset, self.collator, tokens_per_step=self.tokens_per_step, seed=seed, shuffle=True,
            endless=True, flops_model=self._flops_model, lengths=self._train_lengths,
        )
        return loader

    def get_eval_dataloader(self, eval_dataset: Any = None) -> torch.utils.data.DataLoader:
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("LongContextTrainer: evaluation requires an eval_dataset")
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        loader, _ = step_dataloader(
            eval_dataset if eval_dataset is not None else self.eval_dataset, self.eval_collator,
            tokens_per_step=self.tokens_per_step, seed=self.args.seed, shuffle=False, endless=False,
            flops_model=self._flops_model, name="eval_dataset",
        )
        return loader

    def _init_training_state(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        # The step sampler's position comes back with the checkpoint (`_load_optimizer_and_scheduler`),
        # so the Trainer must not also skip batches (its skip would re-plan every skipped step).
        epochs_trained, _ = super()._init_training_state(*args, **kwargs)
        return epochs_trained, 0

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> tuple[list, None]:
        # One item = one step; its normaliser travels in every micro-batch (`num_items_in_batch`
        # of the whole step), so the Trainer's own per-rank count and gather are skipped.
        samples = []
        for _ in range(num_batches):
            try:
                samples.append(next(epoch_iterator))
            except StopIteration:
                break
        return samples, None

    # ---- the step ------------------------------------------------------------------------------
    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        if "micro_batches" not in inputs:
            raise ValueError("LongContextTrainer.training_step expects the step dicts of its own train dataloader")
        model.train()
        self._window.start_step()
        step = self.state.global_step + 1
        micro_batches = inputs["micro_batches"]
        fsdp = hasattr(model, "set_requires_gradient_sync")
        local = torch.zeros((), dtype=torch.float64, device=self.args.device)  # Σ this rank's micro-batch losses
        times: list[float] = []
        unsharded = fsdp and not inputs.get("equal_calls", True)
        with comm_guard(step, self._watchdog.timeout_s if self._watchdog else None), ExitStack() as stack:
            if unsharded:  # unequal counts: gather once, sync in this rank's own last backward
                if not self._unsharded_checked:  # the bytes it needs do not change during the run
                    check_unsharded_step(model, self._world_mesh.world_mesh.get_group())
                    self._unsharded_checked = True
                before_backward = stack.enter_context(unsharded_step(model, len(micro_batches)))
            for i, mb in enumerate(micro_batches):
                t0 = time.perf_counter()
                if fsdp and not unsharded:  # FSDP2: accumulate unsharded, reduce-scatter (a SUM) once, after the last micro-batch
                    model.set_requires_gradient_sync(self.sync_each_microbatch or i == len(micro_batches) - 1)
                mb = self._prepare_inputs(mb)
                with self.compute_loss_context_manager():
                    loss = self.compute_loss(model, mb, num_items_in_batch=mb["num_items_in_batch"])
                if unsharded:
                    before_backward(i)
                self.accelerator.backward(loss)
                local += loss.detach().double()
                times.append(time.perf_counter() - t0)
                if self._watchdog is not None:
                    self._watchdog.beat(step)
            step_loss = global_loss(local, self._world_mesh)  # []: the step's global token mean, on every rank
            every = self.args.torch_empty_cache_steps
            if every is not None and self.state.global_step % every == 0:  # as Trainer.training_step does
                from accelerate.utils import clear_device_cache

                clear_device_cache()
            self._flush_token_stats("train", inputs["tokens"])
        self.last_plan = StepRecord(step, inputs.get("plan"), inputs.get("lengths", ()), inputs.get("plan_stats") or {},
                                    tuple(times))
        self._window.end_step(loss=float(step_loss), tokens=inputs["tokens"], flops=inputs["flops"], balance=inputs["balance"],
                              layouts=inputs.get("layouts"), busy=inputs.get("busy"))
        return step_loss.to(torch.float32)

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        # (2) The model's loss IS this rank's share (local sum / global count): no num_processes factor.
        # TRL's fused LM head is not used (we never pass fused_lm_head=True): the model's own head and
        # loss run, chunked when patched with loss_chunks=N.
        if SP_METADATA_KEY not in inputs:
            raise ValueError("compute_loss needs a shard from the trainer's step dataloader (shard_batch metadata missing)")
        outputs = model(**inputs)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        if self._token_stats is not None:
            self._token_stats.add(outputs.get("logits") if isinstance(outputs, dict) else None, inputs["shift_labels"])
        return (loss, outputs) if return_outputs else loss

    def _flush_token_stats(self, mode: str, tokens: int | None) -> None:
        if self._token_stats is None:
            return
        stats = self._token_stats.flush(self.args.device)
        if stats is not None:
            self._metrics[mode]["entropy"].append(stats[0])
            self._metrics[mode]["mean_token_accuracy"].append(stats[1])
        if mode == "train" and tokens is not None:
            self._total_train_tokens += tokens  # trained tokens of the whole step, once (not per rank)
            self._metrics[mode]["num_tokens"] = [self._total_train_tokens]

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        return self._grad_norm(model, self.args.max_grad_norm)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        return self._grad_norm(model, float("inf")) if grad_norm is None else grad_norm

    def _grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        params = [p for p in model.parameters() if p.grad is not None]
        with comm_guard(self.state.global_step + 1):
            # DTensor gradients: torch reduces the norm over their mesh, i.e. the norm of the whole summed gradient.
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def floating_point_ops(self, inputs: dict[str, Any]) -> float:
        return inputs.get("flops", 0.0) / self.mesh.world_size  # the Trainer sums every rank's share

    def _track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
        if self.args.include_num_input_tokens_seen not in ("no", False):
            self.state.num_input_tokens_seen += inputs["tokens"]  # global already: no gather

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # (3) the logged loss: the mean of the window's global step losses (float64), plus throughput.
        if "loss" in logs:
            logs.update(self._window.drain())
        if "train_loss" in logs and self._window.run_loss is not None:
            logs["train_loss"] = self._window.run_loss
        super().log(logs, start_time)

    # ---- evaluation ------------------------------------------------------------------------------
    def evaluation_loop(self, dataloader: Any, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> EvalLoopOutput:
        # (4) Σ token losses / Σ valid targets over the whole eval set, sharded like training.
        model = self.model
        model.eval()
        t0 = time.perf_counter()
        local = torch.zeros((), dtype=torch.float64, device=self.args.device)  # Σ this rank's token losses
        targets = tokens = 0
        with torch.no_grad(), comm_guard(self.state.global_step):
            for step in dataloader:
                n = step["num_items_in_batch"]
                for mb in step["micro_batches"]:
                    with self.accelerator.autocast():
                        loss = self.compute_loss(model, self._prepare_inputs(mb))
                    local += loss.double() * n  # undo the step normalisation: this rank's token-loss sum
                    if self._watchdog is not None:  # evaluation is progress too (it runs between steps)
                        self._watchdog.beat(self.state.global_step)
                targets += n  # the same on every rank
                tokens += step["tokens"]
            total = global_loss(local, self._world_mesh)  # []: Σ over all ranks
            self._flush_token_stats("eval", None)
        metrics = {
            f"{metric_key_prefix}_loss": float(total) / max(targets, 1),
            f"{metric_key_prefix}_targets": targets,
            f"{metric_key_prefix}_tokens_per_s": tokens / max(time.perf_counter() - t0, 1e-9),
        }
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=len(dataloader.dataset))

    # ---- checkpoints ------------------------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # (5) every rank's shards of model and optimizer + the sampler position; the scheduler as usual.
        os.makedirs(output_dir, exist_ok=True)
        with comm_guard(self.state.global_step), self._watchdog_paused():
            save_sharded(output_dir, self.model, self.optimizer, self._step_sampler, is_main=self.args.should_save)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _watchdog_paused(self):
        return self._watchdog.paused() if self._watchdog is not None else nullcontext()

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        load_sharded(checkpoint, self.model, self.optimizer, self._step_sampler)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # The weights come back with the optimizer state in `_load_optimizer_and_scheduler`
        # (one distributed-checkpoint read, after the optimizer exists).
        return None

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`save_pretrained` of the consolidated model (loads unpatched with `from_pretrained`); inside
        a checkpoint the sharded states stand for the model, so nothing is gathered there."""
        output_dir = output_dir or self.args.output_dir
        if _internal_call:
            os.makedirs(output_dir, exist_ok=True)
            return
        config = getattr(hf_model(self.model), "config", None)
        trained_value = getattr(config, "use_cache", None)
        if config is not None and self._config_use_cache is not None:
            config.use_cache = self._config_use_cache  # the model as loaded, not the Trainer's training-time value
        try:
            with self._watchdog_paused():
                save_consolidated(self.model, output_dir, is_main=self.args.should_save)
        finally:
            if config is not None and trained_value is not None:
                config.use_cache = trained_value
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))


class LongContextTrainer(LongContextTrainerMixin, Trainer):
    """`transformers.Trainer` with exact sequence-parallel long-context training.

    `LongContextTrainer(model=patch(model, mesh), args=TrainingArguments(...), train_dataset=ds,
    mesh=mesh, max_tokens=..., tokens_per_step=...)`: every optimizer step trains
    `tokens_per_step` global tokens, planned into micro-batches of at most `max_tokens` tokens
    per SP group and sharded over the group; the loss is the step's token mean over every rank
    and the gradients are summed, so a step equals a single-device step on the same documents.
    The model is sharded with FSDP2 over the whole DP x SP world. Every `TrainingArguments`
    field and `Trainer` parameter is honoured, mapped or refused at construction
    (`hf_longctx.training.arguments`). The keyword arguments: see `LongContextTrainerMixin`.
    """
