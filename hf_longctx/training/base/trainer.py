"""`SPTrainerBase`: what every trainer of this package overrides in `transformers.Trainer`, once.

Where it sits: in front of the Trainer class in every trainer's bases -- `LongContextTrainerMixin`
(and so `LongContextTrainer`, the TRL SFT composition and `LongDPOTrainer`) and
`SPRolloutTrainer` (`LongGRPOTrainer`, `LongRLOOTrainer`). It holds the hooks that do not
depend on the objective: the checks before `Trainer.__init__` (model patched with the trainer's
mesh, process group, the transformers version that accepts a model sharded before `prepare`),
the model's placement (FSDP2 over the whole DP x SP world, sum reduction; the frozen reference
sharded alike), the norm of the summed gradient for clipping and logging, the step
(`_run_step`: the step's micro-batches through `base/step_loop.py`) and the checkpoint hooks
(every rank's shards, the consolidated model; a checkpoint counts once every rank's files are
in it, and a resume takes the newest complete one). A trainer adds only its objective: data,
micro-batches, loss, metrics.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any

import torch
import transformers
from transformers.training_args import OptimizerNames

from hf_longctx._compat import TRAINER_SHARDED_MODELS, trainer_takes_sharded_models
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.distributed.mesh_protocol import Mesh
from hf_longctx.integrations.accelerate import fsdp_plan
from hf_longctx.model_walk import hf_model
from hf_longctx.training.base import construction as build
from hf_longctx.training.base import saved_folders
from hf_longctx.training.base.mesh_source import launcher_config_hidden, trainer_mesh, without_parallelism_config
from hf_longctx.training.base.resume_choice import resolve_resume
from hf_longctx.training.base.saving import load_step_state, save_step_state, save_trained_model
from hf_longctx.training.base.step_data import StepBatch
from hf_longctx.training.base.step_loop import StepLoop
from hf_longctx.training.base.step_loop import grad_norm as summed_grad_norm
from hf_longctx.training.base.step_record import StepRecord
from hf_longctx.training.refusals.checks import check_adapters, check_materialised, check_mesh_world, check_patched


class SPTrainerBase:
    """Put first in a Trainer subclass's bases; call `_setup_mesh` before `Trainer.__init__`,
    `_place_model` (and `_place_reference` for a frozen reference) after it, and set `step_loop`
    (a `StepLoop`); `training_step` builds the step's `StepBatch` and calls `_run_step`.

    Attributes a subclass may set: `step_sampler` (the data position a checkpoint saves; None:
    the Trainer's own batch skip restores it), `watchdog` (a `WatchdogCallback`, paused while
    saving), `param_offload` (FSDP2 CPU offload of the policy and the reference).
    """

    mesh: Mesh
    world_mesh: SPMesh
    step_sampler: Any = None
    watchdog: Any = None
    param_offload: bool = False
    config_use_cache: bool | None = None
    step_loop: StepLoop
    last_plan: StepRecord | None = None

    # ---- construction -----------------------------------------------------------------------------
    def _resolve_mesh(self, model: Any, args: Any, mesh: Mesh | None, max_tokens: int | None) -> tuple[Mesh, int | None]:
        """`base/mesh_source.trainer_mesh` once per trainer (a subclass may resolve it before the mixin does)."""
        if "_mesh_source" not in self.__dict__:
            self._mesh_source = trainer_mesh(model, args, mesh, trainer=type(self).__name__, max_tokens=max_tokens)
        return self._mesh_source

    def _setup_mesh(self, mesh: Mesh, args: tuple, kwargs: dict, names: tuple[str, ...]) -> tuple[tuple, dict]:
        """Before `Trainer.__init__` (whose parameters, in positional order, are `names`), on every
        rank alike and before any collective: the model patched with `mesh`, its weights off the
        meta device, no adapter dropout added since patch(), the process group's size, and a
        transformers that takes a model sharded before `prepare` (older ones wrap it in DDP).
        Returns the constructor's (args, kwargs) with the training arguments replaced by a copy
        whose HF checkpointing flags became `patch(checkpoint=...)`, whose
        `parallelism_config` became the mesh and whose `max_grad_norm <= 0` became inf (the
        user's object unchanged)."""
        params = {**dict(zip(names, args)), **kwargs}
        model, training_args = params.get("model"), params.get("args")
        check_patched(model, mesh)
        check_materialised(model, type(self).__name__)
        check_adapters(model, type(self).__name__)
        check_mesh_world(mesh)
        if (mesh.world_size > 1 or self.param_offload) and not trainer_takes_sharded_models():
            where = f"on {mesh.world_size} ranks" if mesh.world_size > 1 else "with param_offload=True"
            raise RuntimeError(
                f"{type(self).__name__} {where} needs transformers >= "
                f"{'.'.join(map(str, TRAINER_SHARDED_MODELS))} (its Trainer path for a model sharded before prepare); "
                f"transformers {transformers.__version__} would wrap the FSDP2 model in DDP. Upgrade transformers, or "
                "train on one rank without param_offload"
            )
        self.mesh = mesh
        # Loss all-reduce and FSDP run over the whole world whatever the grouping (DESIGN invariant 6).
        self.world_mesh = mesh.world
        # The Trainer writes args.use_cache into model.config; the saved model keeps the user's value.
        self.config_use_cache = getattr(getattr(hf_model(model), "config", None), "use_cache", None)
        if training_args is None:
            return args, kwargs
        mapped = build.map_activation_checkpointing(model, training_args)
        mapped = without_parallelism_config(mapped, training_args)  # the mesh holds it (base/mesh_source.py)
        mapped = build.norm_without_clipping(mapped, training_args)  # max_grad_norm <= 0: inf, the norm still ours
        return build.with_argument(args, kwargs, names, "args", mapped)

    @property
    def _sharded(self) -> bool:
        """FSDP2 places the model: several ranks, or parameters offloaded to host memory (in one
        process too, FSDP2 over one rank: `fsdp_plan`)."""
        return self.mesh.world_size > 1 or self.param_offload

    def create_accelerator_and_postprocess(self) -> None:
        # The launcher's parallelism config was read into the mesh; Accelerate must not build its own on top.
        with launcher_config_hidden():
            return super().create_accelerator_and_postprocess()

    def _place_model(self) -> None:
        """After `Trainer.__init__`: FSDP2 over DP x SP for the policy (sum reduction), with the
        parameters in host memory under `param_offload` (one process included)."""
        # The Trainer's path for a model that owns placement and gradient reduction: Accelerate
        # prepares autocast only (no `.to()` of DTensor shards, and no DDP -- which it would
        # otherwise wrap around a one-process model whenever a process group exists, e.g. under
        # torchrun with one process, reducing nothing at the cost of a graph traversal per step).
        self.is_distributed_loading_by_transformers = True
        if self._sharded:
            build.shard_model(self.model, self.world_mesh, bf16=self.args.bf16, param_offload=self.param_offload)

    def _place_reference(self, ref: Any) -> None:
        """After `Trainer.__init__`: the frozen reference (`base/reference.py`, patched like the
        policy) sharded like the policy -- forward-only all-gathers, no replica per rank."""
        if self._sharded:
            fsdp_plan(ref, self.world_mesh, mixed_precision="bf16" if self.args.bf16 else "fp32",
                      param_offload=self.param_offload).apply(ref)

    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        if not self._sharded:  # sharded: fully_shard places the shards (on the host under param_offload)
            super()._move_model_to_device(model, device)

    # ---- the step: the micro-batches of one optimizer step (base/step_loop.py) ---------------------
    def _run_step(self, model: torch.nn.Module, batch: StepBatch) -> torch.Tensor:
        """Forward and backward of every micro-batch of `batch` (`_micro_loss`), as
        `Trainer.training_step` does for one; the step's global loss, identical on every rank.
        Keeps the step's `StepRecord` as `last_plan`."""
        model.train()
        if callable(getattr(self.optimizer, "train", None)):  # a schedule-free optimizer's train mode, after
            self.optimizer.train()  # an evaluation switched it to eval mode
        loss = self.step_loop.run(model, batch, step=self.state.global_step + 1,
                                  micro_loss=lambda mb: self._micro_loss(model, mb),
                                  backward=self._backward, device=self.args.device)
        self.last_plan = self.step_loop.last_record
        every = self.args.torch_empty_cache_steps
        if every is not None and self.state.global_step % every == 0:  # as Trainer.training_step does
            from accelerate.utils import clear_device_cache

            clear_device_cache()
        return loss

    def _backward(self, loss: torch.Tensor) -> None:
        # As Trainer.training_step: LOMO / AdaLomo update the parameters inside the backward, at the current rate.
        lomo = self.args.optim in (OptimizerNames.LOMO, OptimizerNames.ADALOMO)
        self.accelerator.backward(loss, **({"learning_rate": self._get_learning_rate()} if lomo else {}))

    def _micro_loss(self, model: torch.nn.Module, micro_batch: Any) -> torch.Tensor:
        """This rank's share of the step's loss on one micro-batch: `_micro_inputs`, then `compute_loss`."""
        inputs = self._micro_inputs(micro_batch)
        with self.compute_loss_context_manager():
            return self.compute_loss(model, inputs, num_items_in_batch=inputs.get("num_items_in_batch"))

    def _micro_inputs(self, micro_batch: Any) -> dict[str, Any]:
        """One micro-batch of the step as the model's inputs on the device. Here the Trainer's
        `_prepare_inputs`; the rollout trainers pack and shard their slot instead, and
        `LongContextTrainerMixin` copies its host shard itself."""
        return self._prepare_inputs(micro_batch)

    # ---- the norm of the summed gradient (every step: max_grad_norm <= 0 reaches the Trainer as inf) --
    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        return summed_grad_norm(model, self.args.max_grad_norm, self.state.global_step + 1)

    # ---- checkpoints: every rank's shards (base/saving.py) ------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        # True: the newest COMPLETE checkpoint; one that is not there or incomplete is named with a fix
        # that works, before the Trainer reads anything (base/resume_choice.py).
        checkpoint = resolve_resume(resume_from_checkpoint, self.args.output_dir, announce=self.is_world_process_zero())
        return super().train(checkpoint, *args, **kwargs)

    def _watchdog_paused(self) -> Any:
        return self.watchdog.paused() if self.watchdog is not None else nullcontext()

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's (and TRL's) checkpoint, which counts only once every rank's files are in it
        (`base/saved_folders.py`); `save_total_limit` then rotates complete checkpoints only."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, HubStrategy

        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        mark = dict(is_main=self.args.should_save, step=self.state.global_step, world_size=self.args.world_size)
        with self._watchdog_paused():  # the barriers wait for the slowest rank's files: no step to beat on
            saved_folders.begin(folder, **mark)
            with saved_folders.trainer_rotation_off(self.args), saved_folders.trainer_push_off(self.args) as push:
                super()._save_checkpoint(model, trial)
            saved_folders.finish(folder, **mark)
        if push and self.args.hub_strategy != HubStrategy.END:  # the consolidated model (a collective), then the upload
            self.save_model(self.args.output_dir)
            self._push_from_checkpoint(folder)  # main process only; the complete folder under hub_strategy="checkpoint"
        if self.args.should_save:
            saved_folders.rotate(run_dir, self.args.save_total_limit, (folder, self.state.best_model_checkpoint))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_step_state(output_dir, self.model, self.optimizer, self.lr_scheduler, self.step_sampler,
                        is_main=self.args.should_save, step=self.state.global_step, paused=self._watchdog_paused())
        self._save_own_state(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None:  # every rank alike, before the collective read
            self._check_own_state(checkpoint)
        load_step_state(checkpoint, self.model, self.optimizer, self.lr_scheduler, self.step_sampler)

    def _save_own_state(self, output_dir: str) -> None:
        """What a trainer keeps beside the step's shards in a checkpoint (the rollout trainers: the
        reference's source); nothing here."""

    def _check_own_state(self, checkpoint: str) -> None:
        """Before the step's shards are read back (a collective), on every rank alike: refuse a
        checkpoint whose own state does not match this trainer; nothing here."""

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        return None  # the weights come back with the optimizer state in `_load_optimizer_and_scheduler`

    def push_to_hub(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's `push_to_hub` of the consolidated model: `save_model(args.output_dir)` first
        (a collective: call it on every rank, as the Trainer says), then its upload of output_dir
        from the main process (the Trainer's own save inside stands for nothing: the model is saved)."""
        self.save_model(self.args.output_dir)
        return super().push_to_hub(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`save_pretrained` of the consolidated model (a collective: call it on every rank; loads
        unpatched with `from_pretrained`); inside a checkpoint the sharded states stand for the
        model, so nothing is gathered there."""
        output_dir = output_dir or self.args.output_dir
        if _internal_call:
            os.makedirs(output_dir, exist_ok=True)
            return
        save_trained_model(
            self.model, output_dir, getattr(hf_model(self.model), "config", None), use_cache=self.config_use_cache,
            processing_class=self.processing_class, args=self.args, paused=self._watchdog_paused(),
        )
