"""TRL's `SFTConfig` fields beyond `TrainingArguments`, classified for `LongContextTrainerMixin`
in front of TRL's `SFTTrainer`: honoured by TRL's own data preparation, or refused.

Where it sits: part of `checks.check_training_arguments`, at construction, on every rank alike
and before any collective.
"""

from __future__ import annotations

from typing import Any

from hf_longctx.integrations.adapter_dropout import config_dropout, shown_config
from hf_longctx.training.refusals.rules import Rule, equals, falsy, refused_rule, refused_trl_fields, trainer_rule


# TRL's SFTConfig fields beyond TrainingArguments (TRL 1.16); LongContextTrainerMixin in front of SFTTrainer.
_TRL_DATA = "TRL's own dataset preparation (tokenising, chat templates, masks folded into labels), which runs unchanged"


SFT_CONFIG: dict[str, Rule] = {
    "model_init_kwargs": refused_rule(
        lambda v: not v, "they apply only when TRL loads the model from a name, and the trainer needs a patched instance",
        "load the model yourself with those kwargs, patch it, and pass model="),
    "trust_remote_code": trainer_rule("used by TRL only when it loads a model or tokenizer from a name"),
    "router_aux_loss_coef": trainer_rule("TRL adds the router loss only with output_router_logits=True, which patch() refuses"),
    "chat_template_path": trainer_rule(_TRL_DATA), "dataset_text_field": trainer_rule(_TRL_DATA),
    "dataset_kwargs": trainer_rule(_TRL_DATA), "dataset_num_proc": trainer_rule(_TRL_DATA), "eos_token": trainer_rule(_TRL_DATA),
    "pad_token": trainer_rule(_TRL_DATA + "; its id pads the micro-batches"),
    "completion_only_loss": trainer_rule(_TRL_DATA + " (completion_mask -> labels -100 on the prompt)"),
    "assistant_only_loss": trainer_rule(_TRL_DATA + " (assistant_masks -> labels -100 elsewhere)"),
    "shuffle_dataset": trainer_rule("TRL shuffles the prepared dataset; the step sampler then draws it in its own seeded order"),
    "max_length": refused_rule(
        lambda v: v is None, "TRL would truncate every longer document silently",
        "pass max_length=None (the cap is the trainer's max_tokens, and overlong= decides what happens above it)"),
    "truncation_mode": trainer_rule("applies only with max_length, which must be None"),
    "packing": refused_rule(falsy, "hf_longctx's planner packs documents itself (cost-balanced, per-document attention)",
                        "set packing=False"),
    "packing_strategy": trainer_rule("applies only with packing, which must be False"),
    "padding_free": refused_rule(falsy, "hf_longctx's planner packs documents itself (cost-balanced, per-document attention)",
                             "set padding_free=False"),
    "eval_packing": refused_rule(lambda v: not v, "evaluation is planned and packed by hf_longctx like training",
                             "leave it None / False"),
    "pad_to_multiple_of": refused_rule(
        lambda v: v is None, "micro-batches are padded by the layout (each document to the ring's multiple, the total to the "
        "SP degree's), not by TRL's collator", "leave it None"),
    "loss_type": refused_rule(equals("nll"), "only 'nll' (the model's token loss) is exact under SP", "use loss_type='nll'"),
    "activation_offloading": refused_rule(
        falsy, "TRL's offloading wraps the forward outside the SP attention binding",
        "use patch(model, mesh, memory='max') (checkpointing with offloaded inputs, K/V offload)"),
}


# TRL's SFTTrainer.__init__ parameters beyond Trainer.__init__'s.
SFT_TRAINER_PARAMETERS: dict[str, Rule] = {
    "formatting_func": trainer_rule(_TRL_DATA),
    # TRL wraps the patched model with get_peft_model before the trainer shards it (the same as wrapping it before
    # patch()), after patch()'s exactness check: an adapter with dropout is refused here, by its config.
    "peft_config": refused_rule(
        lambda v: not config_dropout(v), "adapter dropout draws its masks on each rank's shard of the tokens, so outputs "
        "and gradients would differ from one device's (as attention dropout, which patch() refuses)",
        "set every dropout field of the adapter's config to 0.0, e.g. LoraConfig(..., lora_dropout=0.0)", show=shown_config),
    "quantization_config": refused_rule(
        lambda v: v is None, "TRL applies it only when it loads the model from a name and ignores it for a model "
                             "instance, and the trainer needs a patched instance", "drop it"),
}


def refused_sft_fields(args: Any) -> list[str]:
    """The refused values of TRL `SFTConfig`-only fields (nothing for plain TrainingArguments)."""
    return refused_trl_fields(args, "SFTConfig", SFT_CONFIG)