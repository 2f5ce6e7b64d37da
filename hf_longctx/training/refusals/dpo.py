"""Every TRL `DPOConfig` field (TRL 1.16) classified for sequence-parallel DPO.

Where it sits: before any collective, when a DPO run is configured; the same pattern as
`training/refusals/training_arguments.py` (`SFT_CONFIG`, `refused_sft_fields`). "ours": honoured by
`training/dpo/loss.py` (per-document sums over the SP group, loss over the GLOBAL pairs);
"trainer": TRL's own code path, unaffected by SP; "refused": values whose semantics we do
not reproduce exactly, each with what to do instead. A field missing from the table (newer
TRL) is refused when it differs from its default, so no setting is dropped unseen. The checks
the trainer runs on its mesh, options and datasets are `training/dpo/checks.py`'s.
"""

from __future__ import annotations

from typing import Any

from hf_longctx.errors import NotSupported
from hf_longctx.training.refusals.rules import Rule, falsy, refused_rule, refused_trl_fields, trainer_rule

_TRL_DATA = "TRL's own dataset preparation (tokenising prompt/chosen/rejected, completion masks), which runs unchanged"
# The loss types `training/dpo/loss.dpo_loss` implements on per-document sums (the table's loss_type rule).
LOSS_TYPES = ("sigmoid", "hinge", "ipo")
_PACKED = "hf_longctx packs the pairs itself (chosen and rejected of a pair in the same micro-batch and SP group)"


def _ours(note: str) -> Rule:
    return Rule("ours", note)


def _loss_type_ok(v: Any) -> bool:
    types = [v] if isinstance(v, str) else list(v or [])
    return len(types) == 1 and types[0] in LOSS_TYPES


DPO_CONFIG: dict[str, Rule] = {
    "model_init_kwargs": refused_rule(
        falsy, "they apply only when TRL loads the model from a name, and the trainer needs a patched instance",
        "load the model yourself with those kwargs, patch it, and pass model="),
    "trust_remote_code": trainer_rule("used by TRL only when it loads a model or tokenizer from a name"),
    "router_aux_loss_coef": refused_rule(
        lambda v: v is None or v == 0, "the MoE router loss is a per-rank token average, not reduced over the SP group",
        "leave router_aux_loss_coef=None"),
    "disable_dropout": trainer_rule("TRL zeroes dropout in the models; exactness needs it (keep True)"),
    "dataset_num_proc": trainer_rule(_TRL_DATA), "pad_token": trainer_rule(_TRL_DATA + "; its id pads the micro-batches"),
    "max_length": refused_rule(
        lambda v: v is None, "TRL would truncate every longer pair silently",
        "pass max_length=None (the cap is hf_longctx's max_tokens per micro-batch)"),
    "truncation_mode": trainer_rule("applies only with max_length, which must be None"),
    "padding_free": refused_rule(falsy, _PACKED, "set padding_free=False"),
    "pad_to_multiple_of": refused_rule(
        lambda v: v in (None, "auto"), "micro-batches are padded by the SP layout, not by TRL's collator", "leave it 'auto' or None"),
    "precompute_ref_log_probs": _ours(
        "one SP reference pass over each train / eval dataset at construction (training/dpo/precompute.py), "
        "planned and packed as training; TRL's ref_chosen_logps / ref_rejected_logps columns, then no reference "
        "forward per step and the reference released"),
    "precompute_ref_batch_size": refused_rule(
        lambda v: v is None, "the reference pass packs pairs into micro-batches of max_tokens, as training does; "
        "a pair count per batch has no meaning there",
        "leave precompute_ref_batch_size=None (the pass's batches are max_tokens per SP group, tokens_per_step per step)"),
    "loss_type": refused_rule(
        _loss_type_ok, "only one of " + ", ".join(LOSS_TYPES) + " is implemented on per-document sums",
        "use loss_type='sigmoid' (TRL's default), 'hinge' or 'ipo', one at a time"),
    "loss_weights": refused_rule(lambda v: v is None, "weights apply to several loss types, which are refused",
                             "leave loss_weights=None with a single loss_type"),
    "ld_alpha": refused_rule(lambda v: v is None, "LD-DPO splits each completion's log-probs at the shorter completion's "
                         "length, which doc_sums does not", "leave ld_alpha=None"),
    "f_divergence_type": refused_rule(lambda v: str(getattr(v, "value", v)) == "reverse_kl",
                                  "only standard DPO (reverse KL) is implemented", "leave f_divergence_type='reverse_kl'"),
    "f_alpha_divergence_coef": trainer_rule("applies only with f_divergence_type='alpha_divergence', which is refused"),
    "label_smoothing": trainer_rule("TRL 1.16 applies it only to loss types refused here (robust, exo_pair, aot); "
                                "LongDPOTrainer ignores it as TRL does (dpo_loss's label_smoothing= is cDPO for loops)"),
    "beta": _ours("the DPO temperature"),
    "use_weighting": refused_rule(falsy, "WPO weights are per-token averages not reduced over the SP group",
                              "leave use_weighting=False"),
    "discopop_tau": trainer_rule("applies only with loss_type='discopop', which is refused"),
    "activation_offloading": refused_rule(
        falsy, "TRL's offloading wraps the forward outside the SP attention binding",
        "use patch(model, mesh, memory='max') (checkpointing with offloaded inputs, K/V offload)"),
    "sync_ref_model": refused_rule(falsy, "TR-DPO's reference sync is not implemented with a sharded reference",
                               "leave sync_ref_model=False"),
    "ref_model_mixup_alpha": trainer_rule("applies only with sync_ref_model, which must be False"),
    "ref_model_sync_steps": trainer_rule("applies only with sync_ref_model, which must be False"),
}


def refused_dpo_fields(args: Any) -> list[str]:
    """One line per refused value of a TRL `DPOConfig`-only field (nothing for other args)."""
    return refused_trl_fields(args, "DPOConfig", DPO_CONFIG)


def check_dpo_config(args: Any) -> None:
    """Raise `NotSupported` listing every refused DPOConfig value (call before any collective)."""
    errors = refused_dpo_fields(args)
    if errors:
        raise NotSupported("DPOConfig settings not honoured under sequence parallelism:\n  " + "\n  ".join(errors),
                           "change each setting as its 'do instead' says")


def refuse_dpo(what: str, instead: str) -> None:
    raise NotSupported(f"LongDPOTrainer: {what}", instead)
