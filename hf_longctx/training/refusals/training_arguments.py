"""Every `TrainingArguments` field and every `Trainer.__init__` parameter, classified once:
honoured, mapped, or refused (with what to do instead).

Where it sits: the first thing the trainers run (`checks.check_training_arguments` /
`check_trainer_parameters`), on every rank alike and before any collective, so a setting
the exact-loss contract (invariant 6) cannot keep is one clear `NotSupported` on every rank,
never a hang, a wrong gradient or a silently dropped setting. Kinds: "trainer" (the
Trainer's own code), "ours" (the mixin's code), "mapped" (translated into hf_longctx's
equivalent), "refused" (only the values `ok` accepts; the note says why, `instead` what to
do). A field of a newer transformers missing from the table is refused when it differs
from its default (`unclassified`), and a test fails until the table names it."""

from __future__ import annotations

import dataclasses
from typing import Any

from hf_longctx.training.refusals.rules import (
    Rule, equals, falsy, field_defaults, refusal_message, refused_rule, trainer_rule,
)
from hf_longctx.training.refusals.sft import SFT_TRAINER_PARAMETERS


_NO_DDP = "hf_longctx does not use DDP: fsdp_plan shards the model with FSDP2 over the whole DP x SP world"
_EVAL_LOSS_ONLY = (
    "the evaluation returns the loss only (logits and labels are sharded over the SP group, so compute_metrics is "
    "refused); this option only concerns gathered predictions"
)
_STEP_DATA = "one DataLoader item is one planned optimizer step (training/sft/data.py), built by hf_longctx's step sampler"
_CKPT_KWARGS = frozenset({"use_reentrant"})  # patch(checkpoint=True) is non-reentrant: the only key that is moot

TRAINING_ARGUMENTS: dict[str, Rule] = {
    # -- where and how long -------------------------------------------------------------------
    "output_dir": trainer_rule(),
    "num_train_epochs": trainer_rule("an epoch is the step sampler's first epoch in steps (steps are cut by a token budget)"),
    "max_steps": trainer_rule(),
    # -- optimiser and schedule (built by the Trainer after fsdp_plan shards the model) --------
    "learning_rate": trainer_rule(), "lr_scheduler_type": trainer_rule(), "lr_scheduler_kwargs": trainer_rule(),
    "warmup_steps": trainer_rule(), "optim": trainer_rule(), "optim_args": trainer_rule(), "weight_decay": trainer_rule(),
    "adam_beta1": trainer_rule(), "adam_beta2": trainer_rule(), "adam_epsilon": trainer_rule(), "optim_target_modules": trainer_rule(),
    "max_grad_norm": Rule("ours", "clip_grad_norm_ on the summed (DTensor) gradients: the norm of the true gradient"),
    # -- the batch and the loss ---------------------------------------------------------------
    "per_device_train_batch_size": refused_rule(
        equals(8), "the batch is tokens_per_step global tokens per optimizer step, packed into micro-batches of max_tokens",
        "leave it at its default (8) and size the step with tokens_per_step= on the trainer (LongDPOTrainer counts the "
        "chosen + rejected tokens of whole pairs: about pairs per step x tokens per pair) and the micro-batches with "
        "max_tokens="),
    "per_device_eval_batch_size": refused_rule(
        equals(8), "evaluation is planned like training: tokens_per_step tokens per evaluation step",
        "leave it at its default (8); tokens_per_step sets the evaluation step too"),
    "gradient_accumulation_steps": refused_rule(
        equals(1), "one optimizer step is one planned step whose micro-batch count the planner chooses",
        "set tokens_per_step for a larger batch (the planner accumulates the micro-batches itself)"),
    "average_tokens_across_devices": refused_rule(
        bool, "the loss is always the step's token-loss sum over its GLOBAL target count (exact on any world size)",
        "leave it True"),
    "label_smoothing_factor": refused_rule(
        equals(0), "the loss must be the model's token NLL normalised by the global target count",
        "leave it at 0 (or smooth the labels in the dataset)"),
    "auto_find_batch_size": refused_rule(
        falsy, "the batch is set in tokens (tokens_per_step, max_tokens), not in rows",
        "use `hf-longctx plan` to pick max_tokens and the memory preset"),
    # -- precision ----------------------------------------------------------------------------
    "bf16": Rule("mapped", "fsdp_plan(mixed_precision='bf16'): bf16 compute, fp32 master weights and gradient sums"),
    "fp16": refused_rule(falsy, "the attention kernels refuse fp16 (its range overflows long softmax sums)", "use bf16=True"),
    "bf16_full_eval": refused_rule(
        falsy, "it casts the whole (FSDP-sharded) model to bf16 for evaluation",
        "use bf16=True: evaluation runs under the same mixed precision as training"),
    "fp16_full_eval": refused_rule(falsy, "fp16 is refused by the attention kernels", "use bf16=True"),
    "tf32": trainer_rule(),
    # -- activation checkpointing -------------------------------------------------------------
    "activation_checkpointing": Rule("mapped", "patch(model, mesh, checkpoint=True): recomputation inside the SP attention binding"),
    "gradient_checkpointing": Rule("mapped", "patch(model, mesh, checkpoint=True), as activation_checkpointing"),
    "activation_checkpointing_kwargs": refused_rule(
        lambda v: not v or set(v) <= _CKPT_KWARGS, "checkpointing is hf_longctx's (non-reentrant) own; HF's wrapper options do not apply",
        "pass nothing (or only use_reentrant) and choose the memory knobs with patch(model, mesh, memory=...)"),
    "gradient_checkpointing_kwargs": refused_rule(
        lambda v: not v or set(v) <= _CKPT_KWARGS, "checkpointing is hf_longctx's (non-reentrant) own; HF's wrapper options do not apply",
        "pass nothing (or only use_reentrant) and choose the memory knobs with patch(model, mesh, memory=...)"),
    # -- kernels and graph changes ------------------------------------------------------------
    "torch_compile": trainer_rule(
        "Accelerate's prepare compiles the patched (and sharded) model, as torch.compile(model) after patch(): the "
        "attention, the model hooks and the mixer wrappers run eagerly, the rest of every layer compiles"),
    "torch_compile_backend": trainer_rule("the torch.compile backend (it turns torch_compile on)"),
    "torch_compile_mode": trainer_rule("the torch.compile mode (it turns torch_compile on)"),
    "use_liger_kernel": refused_rule(
        falsy, "Liger replaces the model's forward and loss with Triton kernels (no CPU path to check them against "
        "the sequence-parallel step)", "use patch(model, mesh, fused=True): compiled, fused norms, RoPE, SwiGLU and "
        "loss tail under any memory preset"),
    "liger_kernel_config": refused_rule(lambda v: not v, "it configures use_liger_kernel, which is refused", "leave it None"),
    "neftune_noise_alpha": refused_rule(
        lambda v: v is None, "NEFTune scales its embedding noise by the sequence length, which each rank takes from its shard",
        "leave it None (add noise in a forward hook that uses the global length, if you need it)"),
    "use_cache": Rule("mapped", "training never uses a KV cache (the patched forward passes use_cache=False); the saved "
                                "model keeps its own config.use_cache"),
    "torch_empty_cache_steps": Rule("ours", "training_step empties the device cache every that many steps, as the Trainer does"),
    # -- logging ------------------------------------------------------------------------------
    "logging_strategy": trainer_rule(), "logging_steps": trainer_rule(), "logging_first_step": trainer_rule(),
    "log_on_each_node": trainer_rule(), "logging_nan_inf_filter": trainer_rule(), "log_level": trainer_rule(),
    "log_level_replica": trainer_rule(), "disable_tqdm": trainer_rule(), "report_to": trainer_rule(), "run_name": trainer_rule(),
    "project": trainer_rule(), "trackio_space_id": trainer_rule(), "trackio_bucket_id": trainer_rule(),
    "trackio_static_space_id": trainer_rule(),
    "include_num_input_tokens_seen": Rule("ours", "the step's global trained tokens (no gather needed)"),
    "skip_memory_metrics": trainer_rule(),
    # -- evaluation ---------------------------------------------------------------------------
    "eval_strategy": trainer_rule(), "eval_steps": trainer_rule(), "eval_delay": trainer_rule(), "eval_on_start": trainer_rule(),
    "prediction_loss_only": Rule("mapped", _EVAL_LOSS_ONLY + " (so it is always loss-only; predictions are None)"),
    "eval_do_concat_batches": refused_rule(bool, _EVAL_LOSS_ONLY, "leave it True"),
    "eval_use_gather_object": refused_rule(falsy, _EVAL_LOSS_ONLY, "leave it False"),
    "eval_accumulation_steps": refused_rule(lambda v: v is None, _EVAL_LOSS_ONLY, "leave it None"),
    "include_for_metrics": refused_rule(lambda v: not v, _EVAL_LOSS_ONLY, "leave it empty"),
    "batch_eval_metrics": refused_rule(falsy, _EVAL_LOSS_ONLY, "leave it False"),
    "metric_for_best_model": trainer_rule(), "greater_is_better": trainer_rule(),
    "load_best_model_at_end": refused_rule(
        falsy, "checkpoints hold sharded states, which the Trainer's best-model reload cannot read",
        "leave it False; pick the checkpoint from the logged eval_loss and load it with trainer.train(resume_from_checkpoint=...)"),
    # -- checkpoints --------------------------------------------------------------------------
    "save_strategy": trainer_rule(), "save_steps": trainer_rule(), "save_total_limit": trainer_rule(),
    "save_only_model": refused_rule(
        falsy, "a resumable checkpoint is the sharded model AND optimizer state of every rank (training/base/saving.py)",
        "leave it False; trainer.save_model(dir) exports the consolidated model for from_pretrained"),
    "save_on_each_node": Rule("ours", "save_model writes the consolidated model on each node's main process; sharded "
                                      "checkpoints are written by every rank in any case"),
    "enable_jit_checkpoint": refused_rule(
        falsy, "a checkpoint on SIGTERM is a collective save that every rank must reach; not verified with sharded states",
        "leave it False and use save_steps (resume is exact from any saved step)"),
    "ignore_data_skip": refused_rule(
        falsy, "the step sampler's position is restored with the checkpoint (nothing is skipped or replayed)",
        "leave it False; to start the data over, start a new run from the exported model"),
    "restore_callback_states_from_checkpoint": trainer_rule(),
    "resume_from_checkpoint": trainer_rule("read by your script (trainer.train(resume_from_checkpoint=...)), not by the Trainer"),
    "push_to_hub": Rule("ours", "at every checkpoint, once the folder is complete: the consolidated model saved to "
                               "output_dir (a gather of the whole model per save), then the Trainer's upload; "
                               "trainer.push_to_hub() saves it first too"),
    "hub_token": trainer_rule(), "hub_private_repo": trainer_rule(), "hub_model_id": trainer_rule(),
    "hub_strategy": trainer_rule(), "hub_always_push": trainer_rule(), "hub_revision": trainer_rule(),
    # -- reproducibility and devices ----------------------------------------------------------
    "full_determinism": trainer_rule(), "seed": Rule("ours", "the step sampler's order and the planner's tie-breaks"),
    "data_seed": Rule("ours", "the step sampler's order (default: seed)"),
    "use_cpu": trainer_rule(), "local_rank": trainer_rule("set by the launcher; checked against torch.distributed"),
    "ddp_backend": trainer_rule("the backend when Accelerate initialises the process group"),
    "ddp_timeout": trainer_rule("the collective timeout when Accelerate initialises the process group"),
    "accelerator_config": refused_rule(
        lambda v: v is None or (not v.split_batches and v.dispatch_batches is None and v.even_batches and v.use_seedable_sampler
                                and not v.gradient_accumulation_kwargs),
        "its batching options concern a DataLoader that Accelerate shards; " + _STEP_DATA + " and never goes through Accelerate",
        "leave split_batches / dispatch_batches / even_batches / use_seedable_sampler / gradient_accumulation_kwargs at their defaults"),
    "parallelism_config": Rule(
        "mapped", "the hf_longctx mesh (training/base/mesh_source.py): sp_size -> Ulysses x ring, cp_size -> ring, "
                  "dp_shard_size -> the data-parallel rest, FSDP2 over the world; refused field by field where it cannot "
                  "map (integrations/parallelism_config.py); the Accelerator never sees it"),
    "fsdp": refused_rule(lambda v: not v, _NO_DDP.replace("does not use DDP", "shards the model itself"),
                     "drop it (parameter offload: LongContextTrainer(..., param_offload=True) where available, or fsdp_plan)"),
    "fsdp_config": refused_rule(lambda v: not v, "hf_longctx shards the model itself with fsdp_plan", "drop it"),
    "deepspeed": refused_rule(lambda v: not v, "hf_longctx shards the model itself with FSDP2 (fsdp_plan)", "drop it"),
    "ddp_find_unused_parameters": refused_rule(lambda v: v is None, _NO_DDP, "leave it None"),
    "ddp_bucket_cap_mb": refused_rule(lambda v: v is None, _NO_DDP, "leave it None"),
    "ddp_broadcast_buffers": refused_rule(lambda v: v is None, _NO_DDP, "leave it None"),
    "ddp_static_graph": refused_rule(lambda v: v is None, _NO_DDP, "leave it None"),
    "debug": refused_rule(lambda v: not v, "the underflow/overflow and TPU debug modes are not wired into the SP step", "leave it empty"),
    # -- the data -----------------------------------------------------------------------------
    "train_sampling_strategy": refused_rule(
        equals("random"), "the step sampler draws the documents (seeded by seed / data_seed); shuffling is built in",
        "leave it 'random'"),
    "length_column_name": refused_rule(
        equals("length"), "document lengths are read from the 'length' column (tokenize_dataset writes it) or from input_ids",
        "name the column 'length', or drop it (lengths then come from input_ids)"),
    "label_names": refused_rule(
        lambda v: v is None, "the collator reads the 'labels' column (optional; -100 = no loss) and shifts it per document",
        "put the targets in a 'labels' column"),
    "remove_unused_columns": refused_rule(
        bool, "the collator feeds the model input_ids and labels only; other columns never reach forward()",
        "leave it True; per-token targets or masks go in a 'labels' column (-100 = no loss)"),
    "dataloader_num_workers": refused_rule(
        falsy, "the step sampler's checkpointed position must equal the steps consumed, and workers prefetch",
        "use 0 (planning a step costs milliseconds)"),
    "dataloader_prefetch_factor": refused_rule(lambda v: v is None, "there are no DataLoader workers (see dataloader_num_workers)", "leave it None"),
    "dataloader_persistent_workers": refused_rule(falsy, "there are no DataLoader workers", "leave it False"),
    "dataloader_multiprocessing_context": refused_rule(lambda v: v is None, "there are no DataLoader workers", "leave it None"),
    "dataloader_drop_last": refused_rule(
        falsy, "steps are cut by a token budget and the end of a sampler epoch rolls into the next one: nothing is dropped",
        "leave it False (StepSampler(drop_last=True) for a hand-written loop)"),
    "dataloader_pin_memory": Rule("ours", "the step's host shards are staged in pinned memory before its non-blocking copy (CUDA); False copies unpinned"),
    "dataloader_in_order": Rule("ours", "without workers the steps always come in order"),
    "do_train": trainer_rule("read by your script, not by the Trainer"),
    "do_eval": trainer_rule("read by your script, not by the Trainer"),
    "do_predict": trainer_rule("read by your script, not by the Trainer"),
}

# Trainer.__init__'s parameters (the mixin's own ones -- mesh, max_tokens, ... -- are its docstring's).
TRAINER_PARAMETERS: dict[str, Rule] = {
    "model": Rule("ours", "must be a model instance patched with hf_longctx.patch(model, mesh)"),
    "args": Rule("ours", "every field classified in TRAINING_ARGUMENTS"),
    "data_collator": refused_rule(
        lambda v: v is None,
        "the step's documents are planned, packed and sharded by hf_longctx's collator (labels shifted per document "
        "before sharding); a collator of padded rows would be bypassed",
        "put per-token targets in a 'labels' column (-100 = no loss) or transform documents with dataset.map() before "
        "the trainer; LongContextCollator(loss_mask_key=...) takes a 0/1 loss mask in a hand-written loop"),
    "train_dataset": Rule("ours", "a datasets.Dataset with input_ids (and optional labels / length)"),
    "eval_dataset": Rule("ours", "a datasets.Dataset (or a dict of them) with input_ids"),
    "processing_class": trainer_rule("saved with the model; its pad / EOS id pads the micro-batches unless pad_token_id= is given"),
    "model_init": refused_rule(
        lambda v: v is None, "a model_init builds an unpatched model per trial, after the mesh-bound set-up",
        "load and patch the model yourself and pass model=; for a sweep build one trainer per trial"),
    "compute_loss_func": refused_rule(
        lambda v: v is None, "the loss must be the model's token loss over the step's global target count",
        "use the model's own loss (ForCausalLMLoss); per-token weights go in the 'labels' column (-100 = no loss)"),
    "compute_metrics": refused_rule(
        lambda v: v is None, "logits and labels are sharded over the SP group",
        "evaluate metrics after training on the exported model (trainer.save_model), or use the logged eval_loss"),
    "preprocess_logits_for_metrics": refused_rule(
        lambda v: v is None, "logits are sharded over the SP group and never gathered", "leave it None"),
    "callbacks": trainer_rule(),
    "optimizers": refused_rule(
        lambda v: v is None or all(x is None for x in v),
        "fsdp_plan replaces the parameters by sharded DTensors after construction, so an optimizer built before holds "
        "tensors that are no longer trained",
        "pass optimizer_cls_and_kwargs=(torch.optim.AdamW, {...}) (built after sharding), or override create_optimizer"),
    "optimizer_cls_and_kwargs": trainer_rule("the optimizer is built after fsdp_plan, on the sharded parameters"),
}


def refused_arguments(args: Any) -> list[str]:
    """One line per refused `TrainingArguments` value (a field missing from the table is refused
    when it differs from its default: a setting of a newer transformers is never dropped unseen)."""
    from transformers import TrainingArguments

    errors = []
    defaults = field_defaults(TrainingArguments)
    for f in dataclasses.fields(TrainingArguments):
        value = getattr(args, f.name, None)
        rule = TRAINING_ARGUMENTS.get(f.name)
        if rule is None:
            if f.name in defaults and value != defaults[f.name]:
                errors.append(
                    f"{f.name}={value!r}: hf_longctx has not classified this TrainingArguments field (newer transformers?), "
                    "so it cannot say it is honoured; do instead: leave it at its default and report it"
                )
        elif rule.kind == "refused" and not rule.ok(value):
            errors.append(refusal_message(f.name, value, rule))
    return errors


def refused_parameters(params: dict[str, Any]) -> list[str]:
    """One line per refused `Trainer.__init__` (or TRL `SFTTrainer.__init__`) parameter among
    `params` (name -> value)."""
    errors = []
    for name, value in params.items():
        rule = TRAINER_PARAMETERS.get(name) or SFT_TRAINER_PARAMETERS.get(name)
        if rule is not None and rule.kind == "refused" and not rule.ok(value):
            errors.append(refusal_message(name, value, rule, parameter=True))
    return errors
