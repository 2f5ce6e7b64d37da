"""`LongGRPOTrainer`: TRL's `GRPOTrainer` with its training step exact under sequence parallelism.

Where it sits: a user's GRPOTrainer script plus `mesh=` (the model `patch`ed with it). TRL
keeps its data path; `SPTrainerBase` places the policy and frozen reference and owns the
gradient norm and checkpoints; `SPRolloutTrainer` (`grpo/rollout_trainer.py`, shared with
`LongRLOOTrainer`) replaces generation (sequence-parallel by default: `generation/`; or per rank
on gathered, unpatched weights: `grpo/generate.py`),
`_micro_inputs` and `training_step` (micro-batches under `max_tokens`, run by the shared step
loop `base/step_loop.py`); this class adds GRPO's objective: the packed shard with the
reference log-probabilities (`grpo/loss.py`) and `grpo_loss`. Guarantees: a step equals the
single-process GRPOTrainer step on the union of every process's rows (loss, gradients,
grad_norm, metrics), a resumed step the uninterrupted one, and every refused setting raises
before any collective. Design: DESIGN "GRPO under SP"."""
from __future__ import annotations

import inspect
from typing import Any

from trl import GRPOTrainer

from hf_longctx.devices import to_device
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.training.grpo.loss import GRPOObjective, add_ref_logps, grpo_loss, pack_completions, shard_completions
from hf_longctx.training.grpo.rollout_trainer import Slot, SPRolloutTrainer
from hf_longctx.training.refusals.grpo import check_grpo_trainer

_NUM_SEQUENCES = "grpo_num_sequences"


class LongGRPOTrainer(SPRolloutTrainer, GRPOTrainer):
    """`trl.GRPOTrainer` with `mesh=` (from `init_sequence_parallel`; the model `patch(model, mesh)`ed).

    `LongGRPOTrainer(model=patch(model, mesh), reward_funcs=..., args=GRPOConfig(...),
    train_dataset=ds, processing_class=tok, mesh=mesh)`. Each process draws
    `per_device_train_batch_size` rows of the step (TRL's sampler); the ranks of an SP group
    train on the union of their rows, so one step equals a single-process GRPOTrainer step with
    per_device_train_batch_size x world_size (module docstring). `max_tokens` (default None: one
    packed micro-batch per step): tokens of one packed micro-batch of an SP group; the step's
    rows are split into micro-batches under it with gradient accumulation, the same result
    (`grpo/microbatches.py`). `generation`: "sp" (default; the SP group decodes its ranks' rows
    together, the KV cache sharded over it, each rank sampling its own rows as `generate` would) or
    "per-rank" (TRL's own generate on gathered, unpatched weights). Refused settings: `refusals.grpo.check_grpo_trainer` raises one
    `NotSupported` naming every value.

    Args:
        *args: `trl.GRPOTrainer`'s positional arguments.
        mesh: The mesh (`init_sequence_parallel`) the model is patched with (`patch(model, mesh)`).
        max_tokens: Tokens of one packed micro-batch of an SP group (default None: one
            packed micro-batch per step).
        **kwargs: `trl.GRPOTrainer`'s keyword arguments (`model`, `reward_funcs`, `args`,
            `train_dataset`, `processing_class`, ...).

    Raises:
        NotSupported: Every refused setting, in one error (`refusals.grpo.check_grpo_trainer`).
    """

    _NAME = "GRPO"
    _TRAINER_PARAMETERS = tuple(inspect.signature(GRPOTrainer.__init__).parameters)[1:]  # positional order, without self
    _TRL_INPUTS = frozenset({"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
                             "num_items_in_batch"})

    def _checked_objective(self, mesh: SPMesh, max_tokens: int | None, params: dict[str, Any]) -> GRPOObjective:
        return GRPOObjective.from_config(check_grpo_trainer(mesh, max_tokens, params))

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any):
        # TRL calls it on its padded batch for old (num_iterations > 1, refused) and reference (beta > 0)
        # log-probabilities; here the reference ones are computed on the SP shard (`_shard`).
        return None, None, None

    def _shard(self, slot: Slot) -> dict[str, Any]:
        """One micro-batch's rows -> one packed row (global N and T) -> this rank's shard, with the
        reference log-probabilities for beta > 0 (a forward on every rank)."""
        rows = slot.rows
        packed = pack_completions([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], self.objective,
                                  num_sequences=slot.n, num_tokens=slot.tokens)
        shard = to_device(shard_completions(packed, self.mesh, pad_token_id=self.pad_token_id), self.args.device)
        if self.objective.beta != 0.0:
            add_ref_logps(self.ref_model, shard, self.objective)  # one forward on every rank (FSDP2 all-gathers per unit)
            if hasattr(self.ref_model, "reshard"):  # FSDP2 keeps the root unsharded after forward (for a backward)
                self.ref_model.reshard()
        shard[_NUM_SEQUENCES] = slot.n
        return shard

    def _loss(self, model, inputs):
        return grpo_loss(model, inputs, self.objective, self.mesh, num_sequences=inputs[_NUM_SEQUENCES])
