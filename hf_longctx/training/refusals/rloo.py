"""Every TRL `RLOOConfig` field beyond `TrainingArguments` (TRL 1.16), classified for
`LongRLOOTrainer`: honoured by our step, read by TRL's own trainer code, or refused.

Where it sits: `RLOOObjective.from_config` calls `check_rloo_config` first, on every rank alike
and before any collective; `check_rloo_trainer` adds the rollout trainers' own refusals
(`refusals/rollouts.py`, whose `SHARED_CONFIG` rules this table starts from). Kinds
(`rules.Rule`): "ours" (honoured by `rloo_loss` or the SP scoring pass, `grpo/scoring.py`),
"trainer" (read by TRL's RLOOTrainer, whose data, generation, reward and advantage code runs
unchanged), "refused" (only the values `ok` accepts run; else `NotSupported` with "Do
instead"). A field of a newer TRL missing from the table is refused when it differs from its
default, and tests/unit/test_rloo_arguments.py fails until the table names it."""

from __future__ import annotations

from hf_longctx.training.refusals.rollouts import ConfigChecks, SHARED_CONFIG
from hf_longctx.training.refusals.rules import Rule, trainer_rule

_GENERATION = ("TRL's generation config reads it (sequence-parallel generation applies it as generate would, or "
               "generation='per-rank' runs TRL's generate on the gathered, unpatched policy)")
_LOGGING = "TRL's completion logging (rank 0 prints the gathered rows)"
_BUFFERED = "LongRLOOTrainer refuses values other than 1 (refusals/rollouts.py: TRL's buffered generation batch)"

RLOO_CONFIG: dict[str, Rule] = {
    **SHARED_CONFIG,
    "num_generations": trainer_rule("TRL's sampler repeats each prompt num_generations times; the leave-one-out groups "
                                "are formed by TRL over the whole world"),
    "num_generations_eval": trainer_rule("evaluation only, which LongRLOOTrainer refuses"),
    "max_completion_length": trainer_rule(_GENERATION + " as max_new_tokens"),
    "shuffle_dataset": trainer_rule("TRL's RepeatSampler"),
    "generation_batch_size": trainer_rule("TRL derives steps_per_generation from it, which LongRLOOTrainer keeps at 1 "
                                      "(refusals/rollouts.py)"),
    "steps_per_generation": trainer_rule(_BUFFERED),
    "temperature": Rule("ours", "RLOOObjective.temperature: log-probs of logits / temperature in the loss and the "
                        "scoring pass; also TRL's sampling temperature"),
    **{name: trainer_rule(_GENERATION) for name in ("top_p", "top_k", "min_p", "repetition_penalty", "generation_kwargs",
                                                "cache_implementation", "chat_template_kwargs")},
    "beta": Rule("ours", "the KL penalty in the reward: TRL subtracts beta x the per-completion sum of (policy - "
                 "reference) log-probs, both computed by the SP scoring pass (grpo/scoring.py)"),
    "num_iterations": trainer_rule(_BUFFERED),
    "epsilon": Rule("ours", "RLOOObjective.epsilon_low (clipping of the sequence ratio)"),
    "epsilon_high": Rule("ours", "RLOOObjective.epsilon_high (default: epsilon)"),
    "reward_weights": trainer_rule("TRL's reward sum"),
    "normalize_advantages": trainer_rule("TRL's scoring: normalised over the whole generation batch (every process)"),
    "reward_clip_range": trainer_rule("TRL's scoring clips the summed rewards"),
    "mask_truncated_completions": trainer_rule("LongRLOOTrainer refuses True (refusals/rollouts.py)"),
    **{name: trainer_rule(_LOGGING) for name in ("log_completions", "log_multimodal", "num_completions_to_print",
                                             "log_unique_prompts")},
}


CHECKS = ConfigChecks("RLOOConfig", RLOO_CONFIG, "RLOO", "LongRLOOTrainer")
refused_rloo_fields = CHECKS.refused_fields  # one line per refused value of a RLOOConfig-only field
check_rloo_config = CHECKS.check_config  # raises NotSupported naming every refused RLOOConfig value
check_rloo_trainer = CHECKS.check_trainer  # everything LongRLOOTrainer refuses; returns its RLOOConfig
