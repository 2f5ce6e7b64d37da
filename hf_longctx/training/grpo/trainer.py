"""`LongGRPOTrainer`: TRL's `GRPOTrainer` with its training step exact under sequence parallelism.

Where it sits: a user's GRPOTrainer script plus `mesh=` (the model `patch`ed with it). TRL
keeps its data path; `SPTrainerBase` places the policy and frozen reference and owns the
gradient norm and checkpoints; four hooks are replaced here: generation on gathered,
unpatched weights (`grpo/generate.py`), `_prepare_inputs` (gather, pack, shard:
`grpo/loss.py`), `compute_loss` = `grpo_loss`, and `training_step` (micro-batches under
`max_tokens`, run by the shared step loop `base/step_loop.py`). Guarantees: a step equals the
single-process GRPOTrainer step on the union of every process's rows (loss, gradients,
grad_norm, metrics), a resumed step the uninterrupted one, and every refused setting raises
before any collective. Design: DESIGN "GRPO under SP"."""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from trl import GRPOTrainer

from hf_longctx.devices import to_device
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.errors import NotSupported
from hf_longctx.training.base.log_lines import use_number_logs
from hf_longctx.training.base.reference import check_reference, reference_on_mesh
from hf_longctx.training.base.step_data import StepBatch
from hf_longctx.training.base.step_loop import StepLoop
from hf_longctx.training.base.trainer import SPTrainerBase
from hf_longctx.training.grpo.generate import unpatched_for_generation
from hf_longctx.training.grpo.loss import GRPOObjective, add_ref_logps, grpo_loss, pack_completions, shard_completions
from hf_longctx.training.grpo.microbatches import merge_metrics, plan_rows, slot_tokens
from hf_longctx.training.grpo.resume import (
    check_reference_source, resumable_sampler, save_reference_source, skip_trained_epochs,
)
from hf_longctx.training.refusals.checks import check_process_group
from hf_longctx.training.refusals.grpo import check_grpo_trainer

_TRAINER_PARAMETERS = tuple(inspect.signature(GRPOTrainer.__init__).parameters)[1:]  # positional order, without self
_NUM_SEQUENCES = "grpo_num_sequences"


class LongGRPOTrainer(SPTrainerBase, GRPOTrainer):
    """`trl.GRPOTrainer` with `mesh=` (from `init_sequence_parallel`; the model `patch(model, mesh)`ed).

    `LongGRPOTrainer(model=patch(model, mesh), reward_funcs=..., args=GRPOConfig(...),
    train_dataset=ds, processing_class=tok, mesh=mesh)`. Each process draws
    `per_device_train_batch_size` rows of the step (TRL's sampler); the ranks of an SP group
    train on the union of their rows, so one step equals a single-process GRPOTrainer step with
    per_device_train_batch_size x world_size (module docstring). `max_tokens` (default None: one
    packed micro-batch per step): tokens of one packed micro-batch of an SP group; the step's
    rows are split into micro-batches under it with gradient accumulation, the same result
    (`grpo/microbatches.py`). Refused settings: `refusals.grpo.check_grpo_trainer` raises one
    `NotSupported` naming every value.
    """

    def __init__(self, *args: Any, mesh: SPMesh, max_tokens: int | None = None, **kwargs: Any) -> None:
        params = {**dict(zip(_TRAINER_PARAMETERS, args)), **kwargs}
        config = check_grpo_trainer(mesh, max_tokens, params)  # every refused value at once, before any collective
        self.objective = GRPOObjective.from_config(config)
        if config.beta != 0.0:  # TRL loads the reference from the policy's path inside __init__: its config first
            _check_reference_path(params.get("model"), config)
        # Patched with mesh, process group, transformers version; TRL gets a copy of the config.
        args, kwargs = self._setup_mesh(mesh, args, kwargs, _TRAINER_PARAMETERS)
        self.max_tokens = max_tokens
        self._microbatch_metrics: list[dict[str, float]] = []
        super().__init__(*args, **kwargs)
        use_number_logs(self)  # the progress bar / printer show numbers unquoted
        self._throughput = [0, 0.0]  # trained tokens (prompt + completion, whole world), seconds: since the last log
        check_process_group(self.args)
        self._place_model()
        # TRL logs the step's figures (no StepWindow); every micro-batch's backward reduce-scatters its gradients.
        self.step_loop = StepLoop(self.world_mesh, None, sync_each_microbatch=True)
        if self.ref_model is not None:  # TRL loaded it from the policy's name: patched like the policy, frozen
            self.ref_model = reference_on_mesh(self.ref_model, self.model, mesh)
            self._place_reference(self.ref_model)  # every rank runs the reference's one forward per step

    # ---- (1) generation: TRL's own path on gathered, unpatched weights ------------------------------
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        with unpatched_for_generation(self.model):  # same calls on every rank: FSDP2 all-gathers once, in module order
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any):
        # TRL calls it on its padded batch for old (num_iterations > 1, refused) and reference (beta > 0)
        # log-probabilities; here the reference ones are computed on the SP shard (`_sp_batch`).
        return None, None, None

    # ---- (2) the step's rows -> packed micro-batches of the SP group -> this rank's shards --------------
    def _prepare_inputs(self, slot: Any) -> dict[str, Any]:
        if not isinstance(slot, _Slot):  # the step loop passes the step's micro-batches; nothing else reaches here
            raise NotSupported("GRPO evaluation is not wired to the SP step", "eval_strategy='no'")
        return self._shard(slot)

    def _gather_rows(self, out: dict[str, Any]) -> tuple[list[tuple[list[int], list[int], float]], int, int]:
        """TRL's scored batch of this process (left-padded prompts [B, P], right-padded completions
        [B, C], advantages [B], global num_items_in_batch) -> the SP group's rows (prompt, completion,
        advantage) in SP-rank order, and the step's global N (completions) and T (completion tokens)."""
        extra = sorted(set(out) - {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
                                   "num_items_in_batch"})
        if extra:  # refused at construction; a guard against a newer TRL adding inputs the packed row would drop
            raise NotSupported(f"TRL produced inputs the SP step does not carry: {extra}", "report it")
        p_ids, p_mask = out["prompt_ids"].cpu(), out["prompt_mask"].cpu().bool()  # [B, P]
        c_ids, c_mask = out["completion_ids"].cpu(), out["completion_mask"].cpu().bool()  # [B, C]
        rows = [(p_ids[i][p_mask[i]].tolist(), c_ids[i][c_mask[i]].tolist(), float(out["advantages"][i]))
                for i in range(p_ids.shape[0])]
        counts = torch.tensor([len(rows)], dtype=torch.float64)
        if self.mesh.world_size > 1:
            dist.all_reduce(counts, group=self.mesh.world_mesh.get_group())  # [1]: N, every process's rows are distinct
            if self.mesh.sp > 1:
                table: list[Any] = [None] * self.mesh.sp
                dist.all_gather_object(table, rows, group=self.mesh.sp_group)  # [SP] x ragged rows, in SP-rank order
                rows = [r for part in table for r in part]
        n, tokens = int(counts.item()), int(out["num_items_in_batch"].item())
        if tokens < 1:  # identical on every rank (global count): all raise together
            raise ValueError("no completion token in this step (every completion is empty); raise max_completion_length")
        return rows, n, tokens

    def _shard(self, slot: "_Slot") -> dict[str, Any]:
        """One micro-batch's rows -> one packed row (global N and T) -> this rank's shard, with the
        reference log-probabilities for beta > 0 (a forward on every rank)."""
        rows = slot.rows
        packed = pack_completions([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], self.objective,
                                  num_sequences=slot.n, num_tokens=slot.tokens)
        shard = to_device(shard_completions(packed, self.mesh, pad_token_id=self._tokenizer.pad_token_id), self.args.device)
        if self.objective.beta != 0.0:
            add_ref_logps(self.ref_model, shard, self.objective)  # one forward on every rank (FSDP2 all-gathers per unit)
            if hasattr(self.ref_model, "reshard"):  # FSDP2 keeps the root unsharded after forward (for a backward)
                self.ref_model.reshard()
        shard[_NUM_SEQUENCES] = slot.n
        return shard

    # ---- (3) the loss on the shard; TRL's metrics, global ---------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("The GRPOTrainer does not support returning outputs")
        loss, metrics = grpo_loss(model, inputs, self.objective, self.mesh, num_sequences=inputs[_NUM_SEQUENCES])
        self._microbatch_metrics.append(metrics)  # merged over the step's micro-batches in training_step
        return loss

    # ---- (4) micro-batches with gradient accumulation; logging; the norm of the summed gradient ------
    def training_step(self, model, inputs, num_items_in_batch=None):
        """Generation and scoring once, then the step's packed micro-batches (the same count on every
        rank) through the shared step loop (`_run_step`); returns the step's global loss (the Trainer
        logs the mean over processes: each holds the global loss). Replaces GRPOTrainer.training_step's
        bookkeeping (`_step`, `step_time`) once per optimizer step."""
        start, seen = time.perf_counter(), self.state.num_input_tokens_seen
        model.train()  # as the Trainer's training_step does first: TRL's scoring logs under "train"
        rows, n, tokens = self._gather_rows(self._generate_and_score_completions(inputs))
        lengths = [len(p) + len(c) for p, c, _ in rows]
        bins = plan_rows(lengths, self.mesh, self.max_tokens)  # a collective (max_tokens)
        weights = slot_tokens([len(c) for _, c, _ in rows], bins, self.mesh) if len(bins) > 1 else [float(tokens)]
        self._microbatch_metrics = []
        batch = StepBatch(micro_batches=[_Slot([rows[i] for i in b], n, tokens) for b in bins], num_items_in_batch=tokens,
                          tokens=self.state.num_input_tokens_seen - seen,  # TRL counts the step's tokens globally
                          flops=0.0, plan=None, lengths=tuple(lengths))
        loss = self._run_step(model, batch)  # gradients accumulate: the Trainer zeroes them after the optimizer step
        for name, value in merge_metrics(self._microbatch_metrics, weights).items():
            self._metrics["train"][name].append(value)
        self._step += 1  # GRPOTrainer.training_step's bookkeeping, once per optimizer step (GA is refused: 1)
        seconds = time.perf_counter() - start
        self._metrics["train"]["step_time"].append(seconds)
        self._throughput = [self._throughput[0] + batch.tokens, self._throughput[1] + seconds]
        return loss

    @property
    def last_num_microbatches(self) -> int:
        """Micro-batches of the last step (the same on every rank); 0 before the first."""
        return len(self.last_plan.microbatch_s) if self.last_plan is not None else 0

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # tokens_per_s: the trained (prompt + completion) tokens of the whole world per second of the optimizer steps
        # since the last log, generation included -- TRL counts them globally in num_input_tokens_seen.
        if "loss" in logs and self._throughput[1] > 0:
            logs["tokens_per_s"] = self._throughput[0] / self._throughput[1]
            self._throughput = [0, 0.0]
        super().log(logs, start_time)

    # ---- checkpoints and resume: the base's shards, the reference's source, TRL's sampler (grpo/resume.py) --
    def _get_train_sampler(self, dataset: Any = None) -> Any:
        self._repeat_sampler = resumable_sampler(super()._get_train_sampler(dataset))
        return self._repeat_sampler

    def _init_training_state(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        epochs_trained, steps_in_epoch = super()._init_training_state(*args, **kwargs)
        skip_trained_epochs(getattr(self, "_repeat_sampler", None), epochs_trained)
        self._step = self.state.global_step  # TRL's count of training_step calls: one per optimizer step here
        return epochs_trained, steps_in_epoch

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        save_reference_source(output_dir, self.ref_model, is_main=self.args.should_save)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None:  # every rank alike, before the collective read
            check_reference_source(checkpoint, self.ref_model)
        super()._load_optimizer_and_scheduler(checkpoint)


def _check_reference_path(model: Any, config: Any) -> None:
    """The reference TRL will load (`config._name_or_path` of the policy) against the policy's
    vocabulary and special tokens (`base/reference.check_reference`), before any collective."""
    from transformers import AutoConfig
    from trl.trainer.utils import get_config_model_id

    path = get_config_model_id(model.config) if hasattr(model, "config") else ""
    if path:
        check_reference(AutoConfig.from_pretrained(path, trust_remote_code=config.trust_remote_code), model)


@dataclass(frozen=True)
class _Slot:
    """One micro-batch of the step: its rows (prompt ids, completion ids, advantage) and the step's
    global counts N and T (the loss normalisers)."""

    rows: list[tuple[list[int], list[int], float]]
    n: int
    tokens: int
