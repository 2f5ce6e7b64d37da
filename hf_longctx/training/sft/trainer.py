"""`LongContextTrainerMixin` / `LongContextTrainer`: exact sequence-parallel training through
`transformers.Trainer` (and any subclass, TRL's `SFTTrainer` included).

Where it sits: on top of the whole data flow, in place of a hand-written loop: the Trainer
calls `training_step` once per optimizer step with the `StepBatch` of `sft/data.py`.
Guarantee (invariant 6): each rank's loss is its token-loss sum / the step's GLOBAL target
count and gradients are summed, so a step equals a single-process step on the global batch;
logged and evaluated losses are global token means. `SPTrainerBase` holds placement, the
gradient norm and checkpoints; this mixin adds the token step's overrides. Which stock
behaviour each override replaces: DESIGN "One training path on the Trainer"."""
from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer_utils import EvalLoopOutput

from hf_longctx.data.cost import CostModel, GroupCost
from hf_longctx.data.dataset_columns import require_dataset_targets
from hf_longctx.devices import to_device
from hf_longctx.flex.bank import GroupBank
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.integrations.patch_args import check_mesh
from hf_longctx.model_walk import hf_model
from hf_longctx.training.base import construction as build
from hf_longctx.training.refusals import checks
from hf_longctx.training.refusals.checks import check_process_group, check_trainer_parameters, check_training_arguments
from hf_longctx.training.sft import collators
from hf_longctx.training.base.evaluation import evaluate
from hf_longctx.training.base.faults import WatchdogCallback, comm_guard
from hf_longctx.training.base.log_lines import use_number_logs
from hf_longctx.training.base.metrics import StepWindow
from hf_longctx.training.base.step_data import StepBatch
from hf_longctx.training.base.step_loop import StepLoop, model_loss
from hf_longctx.training.base.step_record import StepRecord
from hf_longctx.training.base.trainer import SPTrainerBase
from hf_longctx.training.sft.data import (
    check_dataset, check_dataset_token_ids, check_lengths, check_step_budget, document_lengths, say_truncation,
    step_dataloader,
)
from hf_longctx.training.sft.token_metrics import TokenStats

_TRAINER_PARAMETERS = tuple(inspect.signature(Trainer.__init__).parameters)[1:]  # positional order, without self


class LongContextTrainerMixin(SPTrainerBase):
    """Put in front of `transformers.Trainer` or any subclass: `class T(LongContextTrainerMixin, SFTTrainer)`.

    An image-text-to-text model patched with image support trains on rows of processor outputs
    (`input_ids`, `pixel_values`, grids, optional `labels`: one document each) through
    `MultimodalCollator`; under TRL's SFTTrainer a conversational dataset with images is first
    run through TRL's own vision collator, one example at a time (`training/sft/vision_data.py`).

    Args:
        *args: The positional arguments of the Trainer class behind it.
        mesh: The mesh (`init_sequence_parallel`) the model is patched with, or a `GroupBank` from `init_group_bank`
            for flexible SP groups; without it, the mesh of `TrainingArguments(parallelism_config=...)` or of the
            launcher's accelerate config (`training/base/mesh_source.py`), with the model patched there if it is not.
        max_tokens: Tokens of one packed micro-batch of an SP group, before sharding (with a bank give
            `max_tokens_per_rank` instead).
        tokens_per_step: Global tokens per optimizer step.
        cost: A `CostModel` (default: FLOPs of the model's config); with a bank a `GroupCost` (default
            `GroupCost.from_config`: FLOPs split over each size plus its communication).
        strategy: The fixed-degree planner's strategy (`plan_microbatches`).
        overlong: "error": refuse documents above max_tokens (with a bank: above the largest group's capacity);
            "split": train their pieces as separate documents; "truncate": keep their first max_tokens tokens, said
            once at construction with the documents and tokens cut.
        pad_token_id: The id of padding tokens (default: the processing class's pad, else EOS, else 0).
        step_timeout_s: A watchdog for hung ranks: when no micro-batch completes for this many seconds the process
            exits with a message naming the step (None: none).
        peak_flops: Peak FLOP/s of one device, for the logged MFU.
        max_tokens_per_rank: With a bank: a group of size s packs at most s × this.
        unequal_calls: With a bank: ranks run different numbers of micro-batches, the model unsharded for the step.
        sync_each_microbatch: Reduce-scatter gradients in every micro-batch's backward (Accelerate's
            `sync_each_batch`: sharded accumulation, 4 B/param less memory, more traffic); default: once per step, in
            the last backward.
        param_offload: FSDP2 `CPUOffloadPolicy` through `fsdp_plan`: sharded parameters, gradients and optimizer
            states in host memory, the optimizer step on the CPU; in one process too, FSDP2 over one rank.
        vision_cost: An image-text-to-text model: the encoder's `VisionCost` in the unit of `cost` (both default to
            FLOPs).
        **kwargs: The Trainer's own keyword arguments (`model`, `args`, `train_dataset`, ...); every
            `TrainingArguments` field and Trainer parameter is honoured, mapped or refused at construction
            (`hf_longctx.training.refusals.training_arguments`).

    Raises:
        NotSupported: A refused `TrainingArguments` field or Trainer parameter, or a model SP cannot train exactly
            (every cause named, on every rank alike, before any collective).
        ValueError: An argument out of range.
    """

    def __init__(
        self, *args: Any, mesh: SPMesh | GroupBank | None = None, max_tokens: int | None = None, tokens_per_step: int,
        cost: CostModel | GroupCost | None = None, strategy: str = "balanced", overlong: str = "error",
        pad_token_id: int | None = None, step_timeout_s: float | None = None, peak_flops: float | None = None,
        max_tokens_per_rank: int | None = None, unequal_calls: bool = False, sync_each_microbatch: bool = False,
        param_offload: bool = False, vision_cost: Any = None, **kwargs: Any,
    ) -> None:
        # Every check runs on every rank alike, before any collective (base/construction.py).
        checks.check_options(unequal_calls, sync_each_microbatch, param_offload)
        self.param_offload = param_offload
        self.last_plan: StepRecord | None = None  # the last step's plan, modelled and measured times
        self.tokens_per_step = checks.positive_int("tokens_per_step", tokens_per_step)
        params = {**dict(zip(_TRAINER_PARAMETERS, args)), **kwargs}
        training_args = params.get("args")
        if training_args is not None:
            check_training_arguments(training_args, type(self).__name__)  # before anything else, on every rank alike
        # Trainer.__init__'s parameters by name (positional ones too), each honoured or refused (refusals/training_arguments.py).
        check_trainer_parameters(params)
        # mesh= or the ParallelismConfig's mesh (base/mesh_source.py: built and the model patched when neither exists)
        mesh, max_tokens = self._resolve_mesh(params.get("model"), training_args, mesh, max_tokens)
        check_mesh(mesh)
        self.max_tokens = checks.check_mesh_arguments(mesh, max_tokens, max_tokens_per_rank, cost, strategy, unequal_calls)
        # Patched with mesh, process group, transformers version; the Trainer gets a copy of the arguments.
        args, kwargs = self._setup_mesh(mesh, args, kwargs, _TRAINER_PARAMETERS)
        user_unused = getattr(training_args, "ddp_find_unused_parameters", None)
        super().__init__(*args, **kwargs)
        use_number_logs(self)  # the progress bar / printer show numbers unquoted
        if user_unused is None and getattr(self.args, "ddp_find_unused_parameters", None):
            # TRL turns it on for a vision-language model (DDP and a tower idle on text-only batches);
            # there is no DDP here: FSDP2 reduces unused parameters itself (integrations/unused_params.py)
            self.args.ddp_find_unused_parameters = None
        check_training_arguments(self.args, type(self).__name__)  # the defaults / TRL's SFTConfig conversion
        check_process_group(self.args)
        self.vision_collator = collators.vision_collator(
            mesh, self.model, max_tokens=self.max_tokens, cost=cost, vision_cost=vision_cost, strategy=strategy,
            overlong=overlong, seed=self.args.seed, pad_token_id=build.pad_id(self.processing_class, pad_token_id),
        )
        if self.vision_collator is not None:  # TRL's conversational image datasets become processor rows
            from hf_longctx.training.sft.vision_data import processed_dataset

            collate, spec = getattr(self, "data_collator", None), self.vision_collator.spec
            self.train_dataset = processed_dataset(self.train_dataset, collate, spec)
            evals = self.eval_dataset
            self.eval_dataset = ({k: processed_dataset(v, collate, spec) for k, v in evals.items()}
                                 if isinstance(evals, dict) else processed_dataset(evals, collate, spec))
        vocab = build.model_vocabulary(self.model)
        self._train_lengths = self._check_train_data(overlong, vocab) if self.train_dataset is not None else None
        hf_config = getattr(hf_model(self.model), "config", None)
        self._flops_model = CostModel.from_config(hf_config) if hf_config is not None else None
        self.collator, self.eval_collator = collators.build_collators(
            mesh, max_tokens=self.max_tokens, max_tokens_per_rank=max_tokens_per_rank, cost=cost,
            flops_model=self._flops_model, hf_config=hf_config, strategy=strategy, overlong=overlong,
            seed=self.args.seed, pad_token_id=build.pad_id(self.processing_class, pad_token_id),
            unequal_calls=unequal_calls, vision=self.vision_collator, vocab=vocab,
        )
        self._place_model()
        self._token_stats = TokenStats() if hasattr(self, "_metrics") else None  # TRL's metric store
        self.watchdog = WatchdogCallback(step_timeout_s) if step_timeout_s else None
        if self.watchdog is not None:
            self.add_callback(self.watchdog)
        window = StepWindow(world_size=mesh.world_size, device=self.args.device, peak_flops=peak_flops)
        self.step_loop = StepLoop(self.world_mesh, window, self.watchdog, sync_each_microbatch=sync_each_microbatch)

    def _check_train_data(self, overlong: str, vocab: Any = None) -> list[int]:
        """The train dataset's document lengths, checked against the caps, its token ids against
        the model's vocabulary, and at least one token with loss (a subclass with other units,
        e.g. the preference pairs of dpo/trainer.py, overrides it; its collate checks the ids
        per step)."""
        check_dataset(self.train_dataset)
        check_dataset_token_ids(self.train_dataset, vocab)
        lengths = document_lengths(self.train_dataset)
        require_dataset_targets(self.train_dataset)  # after document_lengths: a padded row's mask is checked
        check_lengths(lengths, self.max_tokens, overlong)
        check_step_budget(lengths, self.tokens_per_step, self.max_tokens, overlong, warn=self.args.process_index == 0)
        say_truncation(lengths, self.max_tokens, overlong, warn=self.args.process_index == 0)
        return lengths

    # ---- data: one DataLoader item = one optimizer step (sft/data.py) ---------------------------------
    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        if self.train_dataset is None:
            raise ValueError("LongContextTrainer: training requires a train_dataset")
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        loader, self.step_sampler = step_dataloader(
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

    def _prepare_input(self, data: Any) -> Any:
        # A micro-batch's host shard to the device with pinned, non_blocking copies (Trainer's is a blocking .to())
        return to_device(data, self.args.device, pin=self.args.dataloader_pin_memory)

    # ---- the step: (2) the loss as the model returns it (base/step_loop.py) --------------------------
    def training_step(self, model: torch.nn.Module, inputs: StepBatch, num_items_in_batch: Any = None) -> torch.Tensor:
        loss = self._run_step(model, inputs)
        with comm_guard(self.state.global_step + 1):
            self._flush_token_stats("train", inputs.tokens)
        return loss

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        return model_loss(model, inputs, self._token_stats, return_outputs)

    def _flush_token_stats(self, mode: str, tokens: int | None) -> None:
        """TRL's entropy / mean_token_accuracy / num_tokens metrics, as global values (a collective)."""
        if self._token_stats is None:
            return
        stats = self._token_stats.flush(self.args.device)
        if stats is not None:
            self._metrics[mode]["entropy"].append(stats[0])
            self._metrics[mode]["mean_token_accuracy"].append(stats[1])
        if mode == "train" and tokens is not None:
            self._total_train_tokens += tokens  # trained tokens of the whole step, once (not per rank)
            self._metrics[mode]["num_tokens"] = [self._total_train_tokens]

    def floating_point_ops(self, inputs: StepBatch) -> float:
        return getattr(inputs, "flops", 0.0) / self.mesh.world_size  # the Trainer sums every rank's share

    def _track_num_input_tokens(self, inputs: StepBatch) -> None:
        if self.args.include_num_input_tokens_seen not in ("no", False):
            self.state.num_input_tokens_seen += inputs.tokens  # global already: no gather

    # ---- logging: (3) the logged loss is the window's global step losses (metrics.py) ---------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            logs.update(self.step_loop.window.drain())
        if "train_loss" in logs and self.step_loop.window.run_loss is not None:
            logs["train_loss"] = self.step_loop.window.run_loss
        super().log(logs, start_time)

    # ---- evaluation: (4) Σ token losses / Σ targets over the eval set (evaluation.py) ----------------
    def evaluation_loop(self, dataloader: Any, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> EvalLoopOutput:
        if callable(getattr(self.optimizer, "eval", None)):  # as Trainer.evaluation_loop: a schedule-free
            self.optimizer.eval()  # optimizer's evaluation weights (the training step switches back)
        out = evaluate(
            self.model, dataloader, metric_key_prefix,
            micro_loss=lambda mb: self.compute_loss(self.model, self._prepare_inputs(mb)), autocast=self.accelerator.autocast, world_mesh=self.world_mesh, device=self.args.device,
            step=self.state.global_step, watchdog=self.watchdog,
        )
        with comm_guard(self.state.global_step):
            self._flush_token_stats("eval", None)
        return out

class LongContextTrainer(LongContextTrainerMixin, Trainer):
    """`transformers.Trainer` with exact sequence-parallel long-context training.

    `LongContextTrainer(model=patch(model, mesh), args=TrainingArguments(...), train_dataset=ds,
    mesh=mesh, max_tokens=..., tokens_per_step=...)`: every optimizer step trains
    `tokens_per_step` global tokens, planned into micro-batches of at most `max_tokens` tokens
    per SP group and sharded over the group; the loss is the step's token mean over every rank
    and the gradients are summed, so a step equals a single-device step on the same documents.
    The model is sharded with FSDP2 over the whole DP x SP world. Every `TrainingArguments`
    field and `Trainer` parameter is honoured, mapped or refused at construction
    (`hf_longctx.training.refusals.training_arguments`).

    Args:
        *args: The positional arguments of the Trainer class behind it.
        mesh: The mesh (`init_sequence_parallel`) the model is patched with, or a `GroupBank` from `init_group_bank`
            for flexible SP groups; without it, the mesh of `TrainingArguments(parallelism_config=...)` or of the
            launcher's accelerate config (`training/base/mesh_source.py`), with the model patched there if it is not.
        max_tokens: Tokens of one packed micro-batch of an SP group, before sharding (with a bank give
            `max_tokens_per_rank` instead).
        tokens_per_step: Global tokens per optimizer step.
        cost: A `CostModel` (default: FLOPs of the model's config); with a bank a `GroupCost` (default
            `GroupCost.from_config`: FLOPs split over each size plus its communication).
        strategy: The fixed-degree planner's strategy (`plan_microbatches`).
        overlong: "error": refuse documents above max_tokens (with a bank: above the largest group's capacity);
            "split": train their pieces as separate documents; "truncate": keep their first max_tokens tokens, said
            once at construction with the documents and tokens cut.
        pad_token_id: The id of padding tokens (default: the processing class's pad, else EOS, else 0).
        step_timeout_s: A watchdog for hung ranks: when no micro-batch completes for this many seconds the process
            exits with a message naming the step (None: none).
        peak_flops: Peak FLOP/s of one device, for the logged MFU.
        max_tokens_per_rank: With a bank: a group of size s packs at most s × this.
        unequal_calls: With a bank: ranks run different numbers of micro-batches, the model unsharded for the step.
        sync_each_microbatch: Reduce-scatter gradients in every micro-batch's backward (Accelerate's
            `sync_each_batch`: sharded accumulation, 4 B/param less memory, more traffic); default: once per step, in
            the last backward.
        param_offload: FSDP2 `CPUOffloadPolicy` through `fsdp_plan`: sharded parameters, gradients and optimizer
            states in host memory, the optimizer step on the CPU; in one process too, FSDP2 over one rank.
        vision_cost: An image-text-to-text model: the encoder's `VisionCost` in the unit of `cost` (both default to
            FLOPs).
        **kwargs: The Trainer's own keyword arguments (`model`, `args`, `train_dataset`, ...); every
            `TrainingArguments` field and Trainer parameter is honoured, mapped or refused at construction
            (`hf_longctx.training.refusals.training_arguments`).

    Raises:
        NotSupported: A refused `TrainingArguments` field or Trainer parameter, or a model SP cannot train exactly
            (every cause named, on every rank alike, before any collective).
        ValueError: An argument out of range.
    """
