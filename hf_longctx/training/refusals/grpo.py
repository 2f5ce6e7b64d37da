"""Every TRL `GRPOConfig` field beyond `TrainingArguments` (TRL 1.16), classified for the
sequence-parallel GRPO step: honoured, mapped, left to the caller's loop, or refused.

Where it sits: `GRPOObjective.from_config` and `generation_kwargs(args)` call
`check_grpo_config` first, on every rank alike and before any collective; `LongGRPOTrainer`
adds the rollout trainers' own refusals (`refusals/rollouts.py`, whose `SHARED_CONFIG` rules
this table starts from). Kinds (`rules.Rule`): "ours" (honoured by grpo_loss /
grpo_generate), "mapped" (into the sampling kwargs of `hf_generate`), "trainer" (read by
TRL's trainer or the caller's loop; recipes/grpo.py honours each), "refused" (only the
values `ok` accepts run; else `NotSupported` with "Do instead"). A field of a newer TRL
missing from the table is refused when it differs from its default, and
tests/unit/test_grpo_arguments.py fails until the table names it."""

from __future__ import annotations

from hf_longctx.training.refusals.rollouts import ConfigChecks, SHARED_CONFIG, VLLM_ONLY
from hf_longctx.training.refusals.rules import Rule, equals, falsy, refused_rule, trainer_rule


def _ours(note: str) -> Rule:
    return Rule("ours", note)


def _mapped(note: str) -> Rule:
    return Rule("mapped", note)


_LOOP = "read by the caller's loop (recipes/grpo.py), not by the step functions"
_ENTROPY = refused_rule(equals(0.0), "TRL's entropy bonus is a per-micro-batch token mean, not part of the exact global contract",
                    "leave entropy_coef=0.0")

GRPO_CONFIG: dict[str, Rule] = {
    **SHARED_CONFIG,
    **{name: VLLM_ONLY for name in (
        "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
        "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap")},
    "cast_lm_head_to_fp32": _ours("log-probabilities are always computed in fp32 from the logits (grpo.loss.shard_token_logps)"),
    "num_generations": _ours("sp_rollouts(num_generations=...): completions per prompt, generated in one SP group"),
    "num_generations_eval": trainer_rule(_LOOP + " (evaluation rollouts)"),
    "max_completion_length": _ours("GRPOObjective.max_completion_length (dr_grpo's normaliser) and the max_new_tokens of "
                                   "generation_kwargs"),
    "shuffle_dataset": trainer_rule(_LOOP),
    "generation_batch_size": trainer_rule(_LOOP + " (prompts per rollout round)"),
    "steps_per_generation": trainer_rule(_LOOP + " (with num_iterations > 1, pass old_logps to pack_completions)"),
    "temperature": _ours("GRPOObjective.temperature (log-probs of logits / temperature) and the sampling temperature"),
    "top_p": _mapped("generation_kwargs: top_p"), "top_k": _mapped("generation_kwargs: top_k"),
    "min_p": _mapped("generation_kwargs: min_p"), "repetition_penalty": _mapped("generation_kwargs: repetition_penalty"),
    "generation_kwargs": _mapped("merged into generation_kwargs last, as TRL does"),
    "chat_template_kwargs": trainer_rule(_LOOP + " (prompt formatting)"),
    "cache_implementation": _mapped("generation_kwargs: cache_implementation"),
    "beta": _ours("GRPOObjective.beta: the KL term against ref_logps passed to pack_completions"),
    "num_iterations": _ours("ratios against old_logps passed to pack_completions (grpo_loss clips them per token)"),
    "epsilon": _ours("GRPOObjective.epsilon_low"), "epsilon_high": _ours("GRPOObjective.epsilon_high (default: epsilon)"),
    "delta": _ours("GRPOObjective.delta: two-sided clipping of the ratio"),
    **{name: trainer_rule("applies only with loss_type='sapo' / 'vespo', which are refused") for name in (
        "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")},
    "importance_sampling_level": refused_rule(
        equals("token"), "a sequence-level ratio needs each completion's log-ratio sum over all of its SP shards inside the "
        "differentiable loss; not implemented", "use importance_sampling_level='token'"),
    "reward_weights": trainer_rule(_LOOP + " (rewards and advantages are computed before pack_completions)"),
    "multi_objective_aggregation": trainer_rule(_LOOP), "scale_rewards": trainer_rule(_LOOP),
    "loss_type": refused_rule(
        lambda v: v in ("grpo", "dr_grpo", "dapo"), "only 'grpo', 'dr_grpo' and 'dapo' are exact under SP here: 'bnpo' "
        "is a per-process token mean (it depends on how completions fall on ranks); 'cispo', 'sapo', 'vespo' and "
        "'luspo' are not implemented", "use loss_type='dapo' (global token mean), 'grpo' or 'dr_grpo'"),
    "mask_truncated_completions": trainer_rule(_LOOP + " (drop or zero-advantage completions that hit the length cap)"),
    "top_entropy_quantile": refused_rule(equals(1.0), "the high-entropy token mask is a per-batch quantile, different on each "
                                     "shard", "leave top_entropy_quantile=1.0"),
    "entropy_coef": _ENTROPY,
    "use_adaptive_entropy": refused_rule(falsy, "the adaptive entropy controller belongs to TRL's trainer",
                                     "leave use_adaptive_entropy=False"),
    **{name: trainer_rule("applies only with the entropy bonus, which is refused") for name in (
        "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target")},
    "max_tool_calling_iterations": refused_rule(lambda v: v is None, "tool calling is not part of sp_rollouts",
                                            "leave it None"),
    "off_policy_mask_threshold": refused_rule(lambda v: v is None, "the off-policy sequence mask needs per-completion KL "
                                          "sums across SP shards; not implemented", "leave it None"),
    "use_bias_correction_kl": _ours("GRPOObjective.use_bias_correction_kl (KL term times the ratio)"),
    "log_completions": trainer_rule(_LOOP), "log_multimodal": trainer_rule(_LOOP), "num_completions_to_print": trainer_rule(_LOOP),
    "log_unique_prompts": trainer_rule(_LOOP), "log_completions_hub_repo": trainer_rule(_LOOP),
}


CHECKS = ConfigChecks("GRPOConfig", GRPO_CONFIG, "GRPO", "LongGRPOTrainer")
refused_grpo_fields = CHECKS.refused_fields  # one line per refused value of a GRPOConfig-only field
check_grpo_config = CHECKS.check_config  # raises NotSupported naming every refused GRPOConfig value
check_grpo_trainer = CHECKS.check_trainer  # everything LongGRPOTrainer refuses; returns its GRPOConfig
