"""Every TRL `GRPOConfig` field beyond `TrainingArguments` (TRL 1.16), classified for the
sequence-parallel GRPO step: honoured, mapped, left to the caller's loop, or refused.

Where it sits: `GRPOObjective.from_config` and `generation_kwargs(args)` call
`check_grpo_config` first, on every rank alike and before any collective; `LongGRPOTrainer`
adds its own refusals (`refusals`). Kinds (`rules.Rule`): "ours" (honoured by grpo_loss /
grpo_generate), "mapped" (into the sampling kwargs of `hf_generate`), "trainer" (read by
TRL's trainer or the caller's loop; recipes/grpo.py honours each), "refused" (only the
values `ok` accepts run; else `NotSupported` with "Do instead"). A field of a newer TRL
missing from the table is refused when it differs from its default, and
tests/unit/test_grpo_arguments.py fails until the table names it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import transformers

from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.errors import NotSupported
from hf_longctx.training.refusals.rules import Rule, _falsy, _is, refusal_message, _refused, _trainer, refused_config_fields
from hf_longctx.training.refusals.training_arguments import TRAINER_PARAMETERS, TRAINING_ARGUMENTS

if TYPE_CHECKING:
    from trl import GRPOConfig


def _ours(note: str) -> Rule:
    return Rule("ours", note)


def _mapped(note: str) -> Rule:
    return Rule("mapped", note)


_VLLM = _refused(_falsy, "vLLM generation is not wired to the sequence-parallel step (its weight sync assumes TRL's "
                 "DDP/FSDP model, not an FSDP2 model patched for SP)", "generate with grpo.generate.sp_rollouts "
                 "(transformers' generate on gathered weights)")
_VLLM_ONLY = _trainer("applies only with use_vllm, which must be False")
_LOOP = "read by the caller's loop (recipes/grpo.py), not by the step functions"
_ENTROPY = _refused(_is(0.0), "TRL's entropy bonus is a per-micro-batch token mean, not part of the exact global contract",
                    "leave entropy_coef=0.0")

GRPO_CONFIG: dict[str, Rule] = {
    "model_init_kwargs": _refused(lambda v: not v, "they apply only when TRL loads the model from a name; the step "
                                  "needs a patched instance", "load the model yourself with those kwargs and patch it"),
    "trust_remote_code": _trainer("used only when a model or tokenizer is loaded from a name"),
    "router_aux_loss_coef": _refused(lambda v: not v, "the MoE load-balancing loss needs output_router_logits=True, "
                                     "which patch() refuses under SP", "leave it None"),
    "disable_dropout": _trainer("dropout must already be 0 for patch()'s exactness; the caller's model config sets it"),
    "cast_lm_head_to_fp32": _ours("log-probabilities are always computed in fp32 from the logits (grpo.loss._token_logps)"),
    "num_generations": _ours("sp_rollouts(num_generations=...): completions per prompt, generated in one SP group"),
    "num_generations_eval": _trainer(_LOOP + " (evaluation rollouts)"),
    "max_completion_length": _ours("GRPOObjective.max_completion_length (dr_grpo's normaliser) and the max_new_tokens of "
                                   "generation_kwargs"),
    "ds3_gather_for_generation": _ours("FSDP2 weights are always gathered for generation (grpo_generate)"),
    "shuffle_dataset": _trainer(_LOOP),
    "pad_to_multiple_of": _trainer("TRL's padding of its own collated batch; the SP layout pads completions itself "
                                   "(shard_batch)"),
    "generation_batch_size": _trainer(_LOOP + " (prompts per rollout round)"),
    "steps_per_generation": _trainer(_LOOP + " (with num_iterations > 1, pass old_logps to pack_completions)"),
    "temperature": _ours("GRPOObjective.temperature (log-probs of logits / temperature) and the sampling temperature"),
    "top_p": _mapped("generation_kwargs: top_p"), "top_k": _mapped("generation_kwargs: top_k"),
    "min_p": _mapped("generation_kwargs: min_p"), "repetition_penalty": _mapped("generation_kwargs: repetition_penalty"),
    "generation_kwargs": _mapped("merged into generation_kwargs last, as TRL does"),
    "chat_template_kwargs": _trainer(_LOOP + " (prompt formatting)"),
    "cache_implementation": _mapped("generation_kwargs: cache_implementation"),
    "use_vllm": _VLLM,
    **{name: _VLLM_ONLY for name in (
        "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_structured_outputs_regex", "vllm_server_base_url",
        "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port", "vllm_gpu_memory_utilization",
        "vllm_max_model_length", "vllm_tensor_parallel_size", "vllm_importance_sampling_correction",
        "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_cap")},
    "beta": _ours("GRPOObjective.beta: the KL term against ref_logps passed to pack_completions"),
    "num_iterations": _ours("ratios against old_logps passed to pack_completions (grpo_loss clips them per token)"),
    "epsilon": _ours("GRPOObjective.epsilon_low"), "epsilon_high": _ours("GRPOObjective.epsilon_high (default: epsilon)"),
    "delta": _ours("GRPOObjective.delta: two-sided clipping of the ratio"),
    **{name: _trainer("applies only with loss_type='sapo' / 'vespo', which are refused") for name in (
        "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")},
    "importance_sampling_level": _refused(
        _is("token"), "a sequence-level ratio needs each completion's log-ratio sum over all of its SP shards inside the "
        "differentiable loss; not implemented", "use importance_sampling_level='token'"),
    "reward_weights": _trainer(_LOOP + " (rewards and advantages are computed before pack_completions)"),
    "multi_objective_aggregation": _trainer(_LOOP), "scale_rewards": _trainer(_LOOP),
    "loss_type": _refused(
        lambda v: v in ("grpo", "dr_grpo", "dapo"), "only 'grpo', 'dr_grpo' and 'dapo' are exact under SP here: 'bnpo' "
        "is a per-process token mean (it depends on how completions fall on ranks); 'cispo', 'sapo', 'vespo' and "
        "'luspo' are not implemented", "use loss_type='dapo' (global token mean), 'grpo' or 'dr_grpo'"),
    "mask_truncated_completions": _trainer(_LOOP + " (drop or zero-advantage completions that hit the length cap)"),
    "sync_ref_model": _refused(_falsy, "reference-model syncing is TRL trainer state", "keep the reference fixed"),
    "ref_model_mixup_alpha": _trainer("applies only with sync_ref_model, which must be False"),
    "ref_model_sync_steps": _trainer("applies only with sync_ref_model, which must be False"),
    "top_entropy_quantile": _refused(_is(1.0), "the high-entropy token mask is a per-batch quantile, different on each "
                                     "shard", "leave top_entropy_quantile=1.0"),
    "entropy_coef": _ENTROPY,
    "use_adaptive_entropy": _refused(_falsy, "the adaptive entropy controller belongs to TRL's trainer",
                                     "leave use_adaptive_entropy=False"),
    **{name: _trainer("applies only with the entropy bonus, which is refused") for name in (
        "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target")},
    "max_tool_calling_iterations": _refused(lambda v: v is None, "tool calling is not part of sp_rollouts",
                                            "leave it None"),
    "off_policy_mask_threshold": _refused(lambda v: v is None, "the off-policy sequence mask needs per-completion KL "
                                          "sums across SP shards; not implemented", "leave it None"),
    "use_bias_correction_kl": _ours("GRPOObjective.use_bias_correction_kl (KL term times the ratio)"),
    "log_completions": _trainer(_LOOP), "log_multimodal": _trainer(_LOOP), "num_completions_to_print": _trainer(_LOOP),
    "log_unique_prompts": _trainer(_LOOP), "log_completions_hub_repo": _trainer(_LOOP),
    "use_transformers_continuous_batching": _refused(_falsy, "continuous batching is not used by hf_generate",
                                                     "leave it False"),
    "transformers_continuous_batching_config": _trainer("applies only with continuous batching, which must be False"),
    "use_transformers_paged": _refused(_falsy, "paged generation is not used by hf_generate", "leave it False"),
}


def refused_grpo_fields(args: Any) -> list[str]:
    """One line per refused value of a `GRPOConfig`-only field; a field missing from `GRPO_CONFIG`
    is refused when it differs from its default (a newer TRL's field is never dropped unseen)."""
    from trl import GRPOConfig

    if not isinstance(args, GRPOConfig):
        raise TypeError(f"expected a trl.GRPOConfig, got {type(args).__name__}")
    return refused_config_fields(args, GRPOConfig, GRPO_CONFIG)


def check_grpo_config(args: Any) -> None:
    """Raise `NotSupported` naming every refused GRPOConfig value (none: returns)."""
    errors = refused_grpo_fields(args)
    if errors:
        raise NotSupported("GRPOConfig settings the sequence-parallel GRPO step cannot honour exactly:\n  "
                           + "\n  ".join(errors), "change the values listed above as each line says")


# TrainingArguments fields refused here for the reasons refusals/training_arguments.py's table gives (the rest of that table is about
# the token-budget step DataLoader of LongContextTrainerMixin, which GRPO does not use: TRL's sampler draws rows).
_SHARED_REFUSALS = ("fp16", "torch_compile", "torch_compile_backend", "torch_compile_mode", "use_liger_kernel",
                    "neftune_noise_alpha", "fsdp", "fsdp_config", "deepspeed",
                    "gradient_checkpointing_kwargs", "activation_checkpointing_kwargs", "load_best_model_at_end",
                    "enable_jit_checkpoint", "save_only_model")


# TRL's GRPOConfig itself refuses cp_size / sp_size > 1, so the mesh is always given as mesh=.
_GRPO_PARALLELISM = _refused(
    lambda v: v is None, "LongGRPOTrainer takes its mesh as mesh= (GRPOConfig refuses cp_size / sp_size > 1 itself)",
    "drop it and pass mesh=hf_longctx.mesh_from_parallelism_config(pc, model.config) (or init_sequence_parallel)")


def refusals(args: GRPOConfig, params: dict[str, Any]) -> list[str]:
    """One line per setting LongGRPOTrainer does not make exact (beyond `check_grpo_config`), each
    with its "do instead". `params`: GRPOTrainer.__init__'s arguments by name."""
    out = [refusal_message(name, getattr(args, name), TRAINING_ARGUMENTS[name]) for name in _SHARED_REFUSALS
           if name in TRAINING_ARGUMENTS and hasattr(args, name) and not TRAINING_ARGUMENTS[name].ok(getattr(args, name))]
    if getattr(args, "parallelism_config", None) is not None:
        out.append(refusal_message("parallelism_config", args.parallelism_config, _GRPO_PARALLELISM))
    if str(getattr(args.save_strategy, "value", args.save_strategy)) == "best":
        out.append("save_strategy='best': it needs evaluation, which is not wired to the SP step; do instead: "
                   "save_strategy='steps' (or 'epoch') and pick the checkpoint from the logged rewards")
    if args.ignore_data_skip:
        out.append("ignore_data_skip=True: a resumed run would train the rows of the steps already trained again "
                   "(TRL's sampler restarts), not the rows the uninterrupted run trains; do instead: leave it False; "
                   "to start the data over, start a new run from the saved model")
    if args.gradient_accumulation_steps != 1 or args.steps_per_generation != 1:
        out.append(f"gradient_accumulation_steps={args.gradient_accumulation_steps}, steps_per_generation="
                   f"{args.steps_per_generation}: TRL slices a buffered generation batch into accumulation steps; "
                   "LongGRPOTrainer trains one packed generation batch per optimizer step; do instead: keep both at "
                   "1, raise per_device_train_batch_size, and pass LongGRPOTrainer(max_tokens=...) to split the step into "
                   "packed micro-batches of at most max_tokens tokens with gradient accumulation")
    if args.num_iterations != 1:
        out.append(f"num_iterations={args.num_iterations}: the old-policy log-probabilities would come from TRL's "
                   "buffered padded batch; do instead: num_iterations=1 (on-policy), or grpo_step / pack_completions "
                   "with old_logps in your own loop")
    if args.mask_truncated_completions:
        out.append("mask_truncated_completions=True: a masked completion keeps its tokens in the input but none in "
                   "the loss; not verified under SP; do instead: leave it False, or give truncated completions zero "
                   "reward in a reward function")
    if str(getattr(args.eval_strategy, "value", args.eval_strategy)) != "no" or params.get("eval_dataset") is not None:
        out.append("evaluation (eval_strategy / eval_dataset): GRPO evaluation rollouts are not wired to the SP step; "
                   "do instead: eval_strategy='no' and no eval_dataset; evaluate the saved model in one process")
    for name, why in (("peft_config", "adapters and their reference-by-disabling"), ("quantization_config", "quantized "
                      "loading by name"), ("tools", "tool-calling rollouts (tool_mask)"), ("rollout_func", "custom "
                      "rollouts"), ("environment_factory", "environment rollouts")):
        if params.get(name) is not None:
            out.append(f"{name}: {why} are not wired to the SP step; do instead: leave {name}=None")
    optimizers = TRAINER_PARAMETERS["optimizers"]  # the policy is sharded after construction, as for SFT
    if "optimizers" in params and not optimizers.ok(params["optimizers"]):
        out.append(refusal_message("optimizers", params["optimizers"], optimizers, parameter=True))
    if isinstance(params.get("processing_class"), transformers.ProcessorMixin):
        out.append("a multimodal processor: images are not carried through the packed SP row; do instead: a text "
                   "model and its tokenizer")
    return out


def check_grpo_trainer(mesh: Any, max_tokens: Any, params: dict[str, Any]) -> GRPOConfig:
    """Everything LongGRPOTrainer refuses, on every rank alike, before any collective; returns
    its GRPOConfig. `params`: GRPOTrainer.__init__'s arguments by name."""
    from trl import GRPOConfig

    if not isinstance(mesh, SPMesh):
        raise TypeError(f"mesh must be an SPMesh from hf_longctx.init_sequence_parallel, got {type(mesh).__name__}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens must be a positive int (tokens of one packed micro-batch of an SP group) or "
                         f"None (one micro-batch per step), got {max_tokens!r}")
    config = params.get("args")
    if not isinstance(config, GRPOConfig):
        raise TypeError(f"LongGRPOTrainer needs args=GRPOConfig(...) (its batch sizes define the step), got "
                        f"{type(config).__name__}")
    errors = refused_grpo_fields(config) + refusals(config, params)
    if max_tokens is not None and config.max_completion_length + 1 > max_tokens:
        errors.append(f"max_tokens={max_tokens} < max_completion_length={config.max_completion_length} + 1 (a "
                      "one-token prompt): a full-length completion could never fit a micro-batch; do instead: "
                      f"max_tokens >= max_completion_length + the longest prompt")
    if errors:
        raise NotSupported("LongGRPOTrainer cannot honour exactly:\n  " + "\n  ".join(errors),
                           "change the values listed above as each line says")
    return config
