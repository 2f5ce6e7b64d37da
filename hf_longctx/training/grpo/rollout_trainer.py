"""`SPRolloutTrainer`: what `LongGRPOTrainer` and `LongRLOOTrainer` share -- TRL's group-sampled
rollouts feeding a training step exact under sequence parallelism.

Where it sits: in front of TRL's `GRPOTrainer` / `RLOOTrainer` in their bases, behind
`SPTrainerBase`. TRL keeps its data path (sampler, prompts, rewards, advantages, metrics); this
class replaces the hooks both trainers replace alike: generation (`generation="sp"`, the default:
the SP group decodes its ranks' rows together with the KV cache sharded over it,
`generation/rows.py`; "per-rank": TRL's own generate on gathered, unpatched weights,
`grpo/generate.py`), `_micro_inputs` (the step's micro-batch slots), `compute_loss`
(the subclass's `_loss` on the shard, metrics kept per micro-batch) and `training_step` (the SP
group's rows all-gathered, planned under `max_tokens`, run by the shared step loop,
`base/step_loop.py`), plus logging, the reference's source in checkpoints (`grpo/resume.py`) and
refusals of `evaluate` / `predict`. A subclass adds
its objective: `_checked_objective` (every refusal, before any collective), `_shard` (pack and
shard one slot) and `_loss`. Design: DESIGN "GRPO under SP"."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.errors import NotSupported
from hf_longctx.generation.rows import own_rows_rollout
from hf_longctx.generation.settings import sampling_settings
from hf_longctx.model_walk import hf_model
from hf_longctx.training.base.construction import pad_id
from hf_longctx.training.base.log_lines import use_number_logs
from hf_longctx.training.base.reference import check_reference_path, reference_on_mesh
from hf_longctx.training.base.step_data import StepBatch
from hf_longctx.training.base.step_loop import StepLoop
from hf_longctx.training.base.trainer import SPTrainerBase
from hf_longctx.training.grpo.generate import check_generation, unpatched_for_generation
from hf_longctx.training.grpo.microbatches import merge_metrics, plan_rows, slot_tokens
from hf_longctx.training.grpo.resume import (
    RolloutResumeCallback, check_reference_source, resumable_sampler, save_reference_source,
)
from hf_longctx.training.refusals.checks import check_process_group

Row = tuple[list[int], list[int], float]  # prompt ids, completion ids (up to and including EOS), advantage


class SPRolloutTrainer(SPTrainerBase):
    """Put first in the bases of a TRL rollout trainer (`class T(SPRolloutTrainer, GRPOTrainer)`).

    A subclass sets `_NAME`, `_TRAINER_PARAMETERS` (the TRL trainer's `__init__` parameters in positional
    order, without self), `_TRL_INPUTS` (the keys of TRL's scored batch it carries) and
    `_SEQUENCE_MEANS` (logged metrics averaged over completions rather than tokens), and defines
    `_checked_objective(mesh, max_tokens, params)`, `_shard(slot)` and `_loss(model, inputs)`.
    """

    mesh: SPMesh  # a GroupBank is refused (refusals/rollouts.py)
    _NAME = ""  # "GRPO" / "RLOO": in messages
    _TRAINER_PARAMETERS: tuple[str, ...] = ()
    _TRL_INPUTS: frozenset[str] = frozenset()
    _SEQUENCE_MEANS: tuple[str, ...] = ()
    repeat_sampler: Any = None  # TRL's RepeatSampler, made resumable, once the train dataloader is built

    def __init__(self, *args: Any, mesh: SPMesh, max_tokens: int | None = None, generation: str = "sp",
                 **kwargs: Any) -> None:
        params = {**dict(zip(self._TRAINER_PARAMETERS, args)), **kwargs}
        self.objective = self._checked_objective(mesh, max_tokens, params)  # every refused value at once, before any collective
        self.generation = check_generation(generation, params.get("args"))  # a refused sampling option too
        self._sampling: Any = None  # SamplingSettings from TRL's generation_config, at the first rollout
        if self.objective.beta != 0.0:  # TRL loads the reference from the policy's path inside __init__: its config first
            check_reference_path(params.get("model"), params.get("args"))
        # Patched with mesh, process group, transformers version; TRL gets a copy of the config.
        args, kwargs = self._setup_mesh(mesh, args, kwargs, self._TRAINER_PARAMETERS)
        self.max_tokens = max_tokens
        self._microbatch_metrics: list[dict[str, float]] = []
        super().__init__(*args, **kwargs)
        use_number_logs(self)  # the progress bar / printer show numbers unquoted
        self.add_callback(RolloutResumeCallback(self))  # TRL's sampler epoch and step count, on resume
        self._throughput = [0, 0.0]  # trained tokens (prompt + completion, whole world), seconds: since the last log
        # The pad id of the packed rows: TRL's tokenizer's, whose pad it set to EOS where it had none
        self.pad_token_id = pad_id(self.processing_class, None)
        check_process_group(self.args)
        self._place_model()
        # TRL logs the step's figures (no StepWindow); every micro-batch's backward reduce-scatters its gradients.
        self.step_loop = StepLoop(self.world_mesh, None, sync_each_microbatch=True)
        if self.ref_model is not None:  # TRL loaded it from the policy's name: patched like the policy, frozen
            self.ref_model = reference_on_mesh(self.ref_model, self.model, mesh)
            self._place_reference(self.ref_model)  # every rank runs the reference's forwards of a step

    def _checked_objective(self, mesh: SPMesh, max_tokens: int | None, params: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _shard(self, slot: "Slot") -> dict[str, Any]:
        raise NotImplementedError

    def _loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    # ---- (1) generation: the SP group decodes its rows together, or TRL's own path per rank ---------
    _ROLLOUT_LOGPROBS = True  # TRL's hook returns (completion ids, logprobs) (GRPO) or the ids alone (RLOO)

    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        if self.generation == "per-rank":
            with unpatched_for_generation(self.model):  # same calls on every rank: FSDP2 all-gathers once, in module order
                return super()._generate_single_turn(*args, **kwargs)
        prompt_ids = args[0] if args else kwargs["prompt_ids"]
        first = self._sampling is None
        if first:  # TRL's own GenerationConfig, resolved over the model's as generate resolves it
            self._sampling = sampling_settings(self.generation_config, model=hf_model(self.model))
        completions = own_rows_rollout(self.model, prompt_ids, self.mesh, self._sampling,
                                       log=print if first else None)  # names the weights' placement once
        return (completions, None) if self._ROLLOUT_LOGPROBS else completions

    # ---- (2) the step's rows -> packed micro-batches of the SP group -> this rank's shards --------------
    def _micro_inputs(self, slot: Any) -> dict[str, Any]:
        if not isinstance(slot, Slot):  # the step loop passes the step's micro-batches; nothing else reaches here
            raise TypeError(f"{self._NAME}: a micro-batch of the step is a Slot, got {type(slot).__name__}")
        return self._shard(slot)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: evaluation rollouts are not wired to the SP step (the constructor refuses
        eval_strategy and eval_dataset; this refuses a direct call)."""
        raise NotSupported(f"{type(self).__name__}.evaluate(): evaluation rollouts are not wired to the SP step",
                           "evaluate the saved model in one process")

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """Refused, as `evaluate`."""
        raise NotSupported(f"{type(self).__name__}.predict(): prediction is not wired to the SP step",
                           "predict with the saved model in one process")

    def _gather_rows(self, out: dict[str, Any]) -> tuple[list[Row], int, int]:
        """TRL's scored batch of this process (left-padded prompts [B, P], right-padded completions
        [B, C], advantages [B]) -> the SP group's rows (prompt, completion, advantage) in SP-rank
        order, and the step's global N (completions) and T (completion tokens)."""
        extra = sorted(set(out) - self._TRL_INPUTS)
        if extra:  # refused at construction; a guard against a newer TRL adding inputs the packed row would drop
            raise NotSupported(f"TRL produced inputs the SP step does not carry: {extra}", "report it")
        p_ids, p_mask = out["prompt_ids"].cpu(), out["prompt_mask"].cpu().bool()  # [B, P]
        c_ids, c_mask = out["completion_ids"].cpu(), out["completion_mask"].cpu().bool()  # [B, C]
        rows = [(p_ids[i][p_mask[i]].tolist(), c_ids[i][c_mask[i]].tolist(), float(out["advantages"][i]))
                for i in range(p_ids.shape[0])]
        counts = torch.tensor([len(rows), int(c_mask.sum())], dtype=torch.float64)  # [2]: completions, their tokens
        if self.mesh.world_size > 1:
            dist.all_reduce(counts, group=self.mesh.world_mesh.get_group())  # [2]: N, T; every process's rows are distinct
            if self.mesh.sp > 1:
                table: list[Any] = [None] * self.mesh.sp
                dist.all_gather_object(table, rows, group=self.mesh.sp_group)  # [SP] x ragged rows, in SP-rank order
                rows = [r for part in table for r in part]
        n, tokens = int(counts[0].item()), int(counts[1].item())
        if tokens < 1:  # identical on every rank (global count): all raise together
            raise ValueError("no completion token in this step (every completion is empty); raise max_completion_length")
        return rows, n, tokens

    # ---- (3) the loss on the shard; TRL's metrics, global ---------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError(f"The {self._NAME}Trainer does not support returning outputs")
        loss, metrics = self._loss(model, inputs)
        self._microbatch_metrics.append(metrics)  # merged over the step's micro-batches in training_step
        return loss

    # ---- (4) micro-batches with gradient accumulation; logging; the norm of the summed gradient ------
    def training_step(self, model, inputs, num_items_in_batch=None):
        """Generation and scoring once, then the step's packed micro-batches (the same count on every
        rank) through the shared step loop (`_run_step`); returns the step's global loss (the Trainer
        logs the mean over processes: each holds the global loss). Replaces TRL's training_step
        bookkeeping (`_step`, `step_time`) once per optimizer step."""
        start, seen = time.perf_counter(), self.state.num_input_tokens_seen
        model.train()  # as the Trainer's training_step does first: TRL's scoring logs under "train"
        rows, n, tokens = self._gather_rows(self._generate_and_score_completions(inputs))
        lengths = [len(p) + len(c) for p, c, _ in rows]
        bins = plan_rows(lengths, self.mesh, self.max_tokens)  # a collective (max_tokens)
        weights = slot_tokens([len(c) for _, c, _ in rows], bins, self.mesh) if len(bins) > 1 else [float(tokens)]
        sequences = slot_tokens([1] * len(rows), bins, self.mesh) if len(bins) > 1 and self._SEQUENCE_MEANS else None
        self._microbatch_metrics = []
        batch = StepBatch(micro_batches=[Slot([rows[i] for i in b], n, tokens) for b in bins], num_items_in_batch=tokens,
                          tokens=self.state.num_input_tokens_seen - seen,  # TRL counts the step's tokens globally
                          flops=0.0, plan=None, lengths=tuple(lengths))
        loss = self._run_step(model, batch)  # gradients accumulate: the Trainer zeroes them after the optimizer step
        merged = merge_metrics(self._microbatch_metrics, weights, sequences=sequences, per_sequence=self._SEQUENCE_MEANS)
        for name, value in merged.items():
            self._metrics["train"][name].append(value)
        self._step += 1  # TRL's training_step bookkeeping, once per optimizer step (GA is refused: 1)
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
        self.repeat_sampler = resumable_sampler(super()._get_train_sampler(dataset))
        return self.repeat_sampler

    def set_trained_steps(self, steps: int) -> None:
        """TRL's count of `training_step` calls (one per optimizer step here), set to `steps`
        before the first step of `train()` (`grpo/resume.RolloutResumeCallback`)."""
        self._step = steps

    def _save_own_state(self, output_dir: str) -> None:
        save_reference_source(output_dir, self.ref_model, is_main=self.args.should_save)

    def _check_own_state(self, checkpoint: str) -> None:
        check_reference_source(checkpoint, self.ref_model)


@dataclass(frozen=True)
class Slot:
    """One micro-batch of the step: its rows (prompt ids, completion ids, advantage) and the step's
    global counts N and T (the loss normalisers)."""

    rows: list[Row]
    n: int
    tokens: int
