"""`LongRLOOTrainer`: TRL's `RLOOTrainer` with its training step exact under sequence parallelism.

Where it sits: a user's RLOOTrainer script plus `mesh=` (the model `patch`ed with it). TRL keeps
its data path (sampler, prompts, reward functions, the KL penalty in the reward, leave-one-out
advantages, normalisation, metrics); `SPRolloutTrainer` (`grpo/rollout_trainer.py`, shared with
`LongGRPOTrainer`) replaces generation (sequence-parallel by default, or per rank on gathered,
unpatched weights: `generation=`), `_micro_inputs` and
`training_step` (micro-batches under `max_tokens`); this class adds RLOO's pieces: TRL's
scoring hook `_get_per_token_logps_and_entropies` computed under SP (`grpo/scoring.py`: the
policy's and the reference's per-token log-probs whose sums form the KL penalty), the packed
shard (`grpo.loss.pack_rows`) and `rloo_loss`. Guarantees: a step equals the single-process
RLOOTrainer step on the union of every process's rows (loss, gradients, grad_norm, metrics), a
resumed step the uninterrupted one, and every refused setting raises before any collective.
Design: DESIGN "GRPO under SP" (RLOO shares its rollouts)."""
from __future__ import annotations

import inspect
from typing import Any

import torch
from trl import RLOOTrainer

from hf_longctx.devices import to_device
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.errors import NotSupported
from hf_longctx.training.grpo.loss import pack_rows, shard_completions
from hf_longctx.training.grpo.rollout_trainer import Slot, SPRolloutTrainer
from hf_longctx.training.grpo.scoring import padded_token_logps
from hf_longctx.training.refusals.rloo import check_rloo_trainer
from hf_longctx.training.rloo.loss import RLOOObjective, rloo_loss

_ADVANTAGES, _NUM_SEQUENCES = "rloo_advantages", "rloo_num_sequences"


class LongRLOOTrainer(SPRolloutTrainer, RLOOTrainer):
    """`trl.RLOOTrainer` with `mesh=` (from `init_sequence_parallel`; the model `patch(model, mesh)`ed).

    `LongRLOOTrainer(model=patch(model, mesh), reward_funcs=..., args=RLOOConfig(...),
    train_dataset=ds, processing_class=tok, mesh=mesh)`. Each process draws
    `per_device_train_batch_size` rows of the step (TRL's sampler); the ranks of an SP group train
    on the union of their rows, so one step equals a single-process RLOOTrainer step with
    per_device_train_batch_size x world_size. `max_tokens` (default None: one packed micro-batch
    per step): tokens of one packed micro-batch of an SP group, for the scoring forwards and the
    training step alike (gradient accumulation, the same result). Refused settings:
    `refusals.rloo.check_rloo_trainer` raises one `NotSupported` naming every value.

    Args:
        *args: `trl.RLOOTrainer`'s positional arguments.
        mesh: The mesh (`init_sequence_parallel`) the model is patched with (`patch(model, mesh)`).
        max_tokens: Tokens of one packed micro-batch of an SP group (default None: one
            packed micro-batch per step).
        **kwargs: `trl.RLOOTrainer`'s keyword arguments (`model`, `reward_funcs`, `args`,
            `train_dataset`, `processing_class`, ...).

    Raises:
        NotSupported: Every refused setting, in one error (`refusals.rloo.check_rloo_trainer`).
    """

    _NAME = "RLOO"
    _ROLLOUT_LOGPROBS = False  # TRL's RLOO generation hook returns the completion ids alone
    _TRAINER_PARAMETERS = tuple(inspect.signature(RLOOTrainer.__init__).parameters)[1:]  # positional order, without self
    _TRL_INPUTS = frozenset({"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "old_logps", "advantages"})
    _SEQUENCE_MEANS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")

    def _checked_objective(self, mesh: SPMesh, max_tokens: int | None, params: dict[str, Any]) -> RLOOObjective:
        return RLOOObjective.from_config(check_rloo_trainer(mesh, max_tokens, params))

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal: Any):
        """TRL's scoring pass (no grad): the policy's (`old_per_token_logps`) and, for beta != 0, the
        reference's log-probs of its padded batch, [B, C], computed on the SP shards
        (`grpo/scoring.py`). The loss does not come here (`compute_loss` is `rloo_loss`)."""
        extra = sorted(k for k, v in multimodal.items() if v is not None)
        if compute_entropy or compute_aux_loss or extra:  # refused at construction; a guard against a newer TRL
            raise NotSupported(f"RLOO scoring asked for entropy={compute_entropy}, aux_loss={compute_aux_loss}, "
                               f"inputs {extra}", "report it")
        if model is self.model and self.objective.beta == 0.0:
            # Without the KL penalty TRL reads the policy's log-probs only as old_logps, the denominator of the
            # ratio; on-policy the loss takes its own forward's sums, detached, instead: no forward here.
            return torch.zeros(input_ids.shape[0], logits_to_keep, device=input_ids.device), None, None
        logps = padded_token_logps(model, input_ids, attention_mask, logits_to_keep, self.mesh,
                                   temperature=self.objective.temperature, max_tokens=self.max_tokens,
                                   pad_token_id=self.pad_token_id, device=self.args.device)
        return logps, None, None

    def _shard(self, slot: Slot) -> dict[str, Any]:
        """One micro-batch's rows -> one packed row (a document per completion) -> this rank's shard."""
        packed = pack_rows([r[0] for r in slot.rows], [r[1] for r in slot.rows])
        shard = to_device(shard_completions(packed, self.mesh, pad_token_id=self.pad_token_id), self.args.device)
        shard[_ADVANTAGES], shard[_NUM_SEQUENCES] = [r[2] for r in slot.rows], slot.n
        return shard

    def _loss(self, model, inputs):
        return rloo_loss(model, inputs, self.objective, self.mesh, inputs[_ADVANTAGES], inputs[_NUM_SEQUENCES])
