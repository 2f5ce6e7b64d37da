"""What the sequence-parallel rollout trainers (`LongGRPOTrainer`, `LongRLOOTrainer`) classify
alike: the TRL config fields both read the same way (model loading, vLLM, reference syncing,
continuous batching), and the trainer settings both refuse (TRL's buffered generation batch,
evaluation, adapters, a prebuilt optimizer, ...).

Where it sits: under `refusals/grpo.py` and `refusals/rloo.py`, whose tables start from
`SHARED_CONFIG`; `check_rollout_trainer` runs every check of a trainer's construction on every
rank alike, before any collective, and raises one `NotSupported` naming every value. Rollouts:
sequence-parallel generation on the training mesh (`generation/`, the default), or TRL's
transformers path on gathered, unpatched weights per rank (`generation="per-rank"`,
`grpo/generate.py`); vLLM (server or colocate) is refused with the reason in `_VLLM`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import transformers

from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.distributed.mesh_protocol import Mesh
from hf_longctx.errors import NotSupported
from hf_longctx.training.refusals.rules import (
    Rule, falsy, refusal_message, refused_config_fields, refused_rule, trainer_rule,
)
from hf_longctx.training.refusals.training_arguments import TRAINER_PARAMETERS, TRAINING_ARGUMENTS

_VLLM = refused_rule(
    falsy, "vLLM generation is not wired to the sequence-parallel step: server mode pushes the weights after every "
    "step through TRL's VLLMClient over vLLM's NCCL weight-transfer engine (the client needs the vllm package, its "
    "init_communicator a CUDA device: it raises on any other), which this library cannot verify without vllm, CUDA "
    "and NCCL; "
    "and TRL's weight walk (VLLMGeneration._iter_named_params) sees FSDP only through Accelerate's fsdp_plugin, so "
    "on this trainer's FSDP2 model (sharded outside Accelerate) it would stream each rank's DTensor shard, not the "
    "gathered weight; colocate mode runs a second vLLM engine inside every training process",
    "use_vllm=False: the rollouts run on the training mesh (sequence-parallel generation, or with "
    "generation='per-rank' TRL's transformers generation on the gathered, unpatched policy on every rank)")
VLLM_ONLY = trainer_rule("applies only with use_vllm, which must be False")
VLLM_FIELDS = (
    "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_structured_outputs_regex", "vllm_server_base_url",
    "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port", "vllm_gpu_memory_utilization",
    "vllm_max_model_length", "vllm_tensor_parallel_size")

SHARED_CONFIG: dict[str, Rule] = {
    "model_init_kwargs": refused_rule(lambda v: not v, "they apply only when TRL loads the model from a name; the step "
                                  "needs a patched instance", "load the model yourself with those kwargs and patch it"),
    "trust_remote_code": trainer_rule("used only when a model or tokenizer is loaded from a name"),
    "router_aux_loss_coef": refused_rule(lambda v: not v, "the MoE load-balancing loss needs output_router_logits=True, "
                                     "which patch() refuses under SP", "leave it None"),
    "disable_dropout": trainer_rule("dropout must already be 0 for patch()'s exactness; the caller's model config sets it"),
    "ds3_gather_for_generation": Rule("ours", "FSDP2 weights are always gathered for generation (grpo/generate.py)"),
    "pad_to_multiple_of": trainer_rule("TRL's padding of its own collated batch; the SP layout pads completions itself "
                                   "(shard_batch)"),
    "use_vllm": _VLLM,
    **{name: VLLM_ONLY for name in VLLM_FIELDS},
    "sync_ref_model": refused_rule(falsy, "reference-model syncing is TRL trainer state", "keep the reference fixed"),
    "ref_model_mixup_alpha": trainer_rule("applies only with sync_ref_model, which must be False"),
    "ref_model_sync_steps": trainer_rule("applies only with sync_ref_model, which must be False"),
    "use_transformers_continuous_batching": refused_rule(falsy, "continuous batching is not used by hf_generate",
                                                     "leave it False"),
    "transformers_continuous_batching_config": trainer_rule("applies only with continuous batching, which must be False"),
    "use_transformers_paged": refused_rule(falsy, "paged generation is not used by hf_generate", "leave it False"),
}

@dataclass(frozen=True)
class ConfigChecks:
    """The checks of one TRL config (`config_name`, e.g. "RLOOConfig") by its table of `Rule`s, for the
    `step` ("RLOO") and its SP trainer (`trainer`, "LongRLOOTrainer")."""

    config_name: str
    table: dict[str, Rule]
    step: str
    trainer: str

    def refused_fields(self, args: Any) -> list[str]:
        """One line per refused value of a field the config adds to TrainingArguments; a field missing
        from the table is refused when it differs from its default (a newer TRL's is never dropped unseen)."""
        import trl

        config_cls = getattr(trl, self.config_name)
        if not isinstance(args, config_cls):
            raise TypeError(f"expected a trl.{self.config_name}, got {type(args).__name__}")
        return refused_config_fields(args, config_cls, self.table)

    def check_config(self, args: Any) -> None:
        """Raise `NotSupported` naming every refused value of `args` (none: returns)."""
        errors = self.refused_fields(args)
        if errors:
            raise NotSupported(f"{self.config_name} settings the sequence-parallel {self.step} step cannot honour "
                               "exactly:\n  " + "\n  ".join(errors), "change the values listed above as each line says")

    def check_trainer(self, mesh: Mesh, max_tokens: Any, params: dict[str, Any]) -> Any:
        """Everything the trainer refuses, on every rank alike, before any collective; returns its
        config. `params`: the TRL trainer's __init__ arguments by name."""
        return check_rollout_trainer(mesh, max_tokens, params, self)


# TrainingArguments fields refused here for the reasons refusals/training_arguments.py's table gives (the rest of that table is about
# the token-budget step DataLoader of LongContextTrainerMixin, which these trainers do not use: TRL's sampler draws rows).
_COMPILE = refused_rule(
    lambda v: not v, "each rollout step takes the SP patch off for generation and puts it back under a new attention "
    "registration (generation='per-rank', grpo/generate.py) or runs the patched attention's decode path "
    "(generation='sp'), so a compiled policy's graphs would be invalidated and retraced every step (not verified "
    "to stay exact)", "leave torch_compile off with the rollout trainers (LongContextTrainer and "
    "LongDPOTrainer honour torch_compile=True)")
ROLLOUT_COMPILE = {"torch_compile": _COMPILE, "torch_compile_backend": _COMPILE, "torch_compile_mode": _COMPILE}
_SHARED_REFUSALS = ("fp16", "use_liger_kernel",
                    "neftune_noise_alpha", "fsdp", "fsdp_config", "deepspeed",
                    "gradient_checkpointing_kwargs", "activation_checkpointing_kwargs", "load_best_model_at_end",
                    "enable_jit_checkpoint", "save_only_model")


# TRL's GRPOConfig and RLOOConfig refuse cp_size / sp_size > 1 themselves, so the mesh is always given as mesh=.
def _parallelism(name: str) -> Rule:
    return refused_rule(
        lambda v: v is None, f"{name} takes its mesh as mesh= (TRL's config refuses cp_size / sp_size > 1 itself)",
        "drop it and pass mesh=hf_longctx.mesh_from_parallelism_config(pc, model.config) (or init_sequence_parallel)")


def refusals(args: Any, params: dict[str, Any], name: str = "LongGRPOTrainer") -> list[str]:
    """One line per setting the rollout trainer `name` does not make exact (beyond its config table),
    each with its "do instead". `params`: the TRL trainer's __init__ arguments by name."""
    out = [refusal_message(f, getattr(args, f), TRAINING_ARGUMENTS[f]) for f in _SHARED_REFUSALS
           if f in TRAINING_ARGUMENTS and hasattr(args, f) and not TRAINING_ARGUMENTS[f].ok(getattr(args, f))]
    out += [refusal_message(f, getattr(args, f), rule) for f, rule in ROLLOUT_COMPILE.items()
            if hasattr(args, f) and not rule.ok(getattr(args, f))]
    if getattr(args, "parallelism_config", None) is not None:
        out.append(refusal_message("parallelism_config", args.parallelism_config, _parallelism(name)))
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
                   f"{name} trains one packed generation batch per optimizer step; do instead: keep both at "
                   f"1, raise per_device_train_batch_size, and pass {name}(max_tokens=...) to split the step into "
                   "packed micro-batches of at most max_tokens tokens with gradient accumulation")
    if args.num_iterations != 1:
        out.append(f"num_iterations={args.num_iterations}: the old-policy log-probabilities would come from TRL's "
                   "buffered padded batch; do instead: num_iterations=1 (on-policy)"
                   + (", or grpo_step / pack_completions with old_logps in your own loop" if "GRPO" in name else ""))
    if args.mask_truncated_completions:
        out.append("mask_truncated_completions=True: a masked completion keeps its tokens in the input but none in "
                   "the loss; not verified under SP; do instead: leave it False, or give truncated completions zero "
                   "reward in a reward function")
    if str(getattr(args.eval_strategy, "value", args.eval_strategy)) != "no" or params.get("eval_dataset") is not None:
        out.append("evaluation (eval_strategy / eval_dataset): evaluation rollouts are not wired to the SP step; "
                   "do instead: eval_strategy='no' and no eval_dataset; evaluate the saved model in one process")
    for param, why in (("peft_config", "adapters and their reference-by-disabling"), ("quantization_config", "quantized "
                       "loading by name"), ("tools", "tool-calling rollouts (tool_mask)"), ("rollout_func", "custom "
                       "rollouts"), ("environment_factory", "environment rollouts")):
        if params.get(param) is not None:
            out.append(f"{param}: {why} are not wired to the SP step; do instead: leave {param}=None")
    optimizers = TRAINER_PARAMETERS["optimizers"]  # the policy is sharded after construction, as for SFT
    if "optimizers" in params and not optimizers.ok(params["optimizers"]):
        out.append(refusal_message("optimizers", params["optimizers"], optimizers, parameter=True))
    if isinstance(params.get("processing_class"), transformers.ProcessorMixin):
        out.append("a multimodal processor: images are not carried through the packed SP row; do instead: a text "
                   "model and its tokenizer")
    return out


def check_rollout_trainer(mesh: Mesh, max_tokens: Any, params: dict[str, Any], checks: ConfigChecks) -> Any:
    """Everything the rollout trainer `checks.trainer` refuses, on every rank alike, before any
    collective; returns its config (a TRL `checks.config_name`). `params`: the TRL trainer's
    __init__ arguments by name."""
    import trl

    config_cls, name = getattr(trl, checks.config_name), checks.trainer
    if not isinstance(mesh, SPMesh):
        raise TypeError(f"mesh must be an SPMesh from hf_longctx.init_sequence_parallel, got {type(mesh).__name__}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens must be a positive int (tokens of one packed micro-batch of an SP group) or "
                         f"None (one micro-batch per step), got {max_tokens!r}")
    config = params.get("args")
    if not isinstance(config, config_cls):
        raise TypeError(f"{name} needs args={config_cls.__name__}(...) (its batch sizes define the step), got "
                        f"{type(config).__name__}")
    errors = checks.refused_fields(config) + refusals(config, params, name)
    if max_tokens is not None and config.max_completion_length + 1 > max_tokens:
        errors.append(f"max_tokens={max_tokens} < max_completion_length={config.max_completion_length} + 1 (a "
                      "one-token prompt): a full-length completion could never fit a micro-batch; do instead: "
                      f"max_tokens >= max_completion_length + the longest prompt")
    if errors:
        raise NotSupported(f"{name} cannot honour exactly:\n  " + "\n  ".join(errors),
                           "change the values listed above as each line says")
    return config
