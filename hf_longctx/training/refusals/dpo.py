"""Every TRL `DPOConfig` field (TRL 1.16) classified for sequence-parallel DPO.

Where it sits: before any collective, when a DPO run is configured; the same pattern as
`training/refusals/training_arguments.py` (`SFT_CONFIG`, `refused_sft_fields`). "ours": honoured by
`training/dpo/loss.py` (per-document sums over the SP group, loss over the GLOBAL pairs);
"trainer": TRL's own code path, unaffected by SP; "refused": values whose semantics we do
not reproduce exactly, each with what to do instead. A field missing from the table (newer
TRL) is refused when it differs from its default, so no setting is dropped unseen.
"""

from __future__ import annotations

from typing import Any

from hf_longctx.errors import NotSupported
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.integrations.logprob_head import check_logprob_head
from hf_longctx.training.dpo.data import pair_format
from hf_longctx.training.dpo.loss import LOSS_TYPES
from hf_longctx.training.dpo.ref_columns import check_fixed_rows, stored_columns
from hf_longctx.training.refusals.checks import check_patched
from hf_longctx.training.refusals.rules import Rule, _falsy, _refused, _trainer, refused_trl_fields

_TRL_DATA = "TRL's own dataset preparation (tokenising prompt/chosen/rejected, completion masks), which runs unchanged"
_PACKED = "hf_longctx packs the pairs itself (chosen and rejected of a pair in the same micro-batch and SP group)"


def _ours(note: str) -> Rule:
    return Rule("ours", note)


def _loss_type_ok(v: Any) -> bool:
    types = [v] if isinstance(v, str) else list(v or [])
    return len(types) == 1 and types[0] in LOSS_TYPES


DPO_CONFIG: dict[str, Rule] = {
    "model_init_kwargs": _refused(
        _falsy, "they apply only when TRL loads the model from a name, and the trainer needs a patched instance",
        "load the model yourself with those kwargs, patch it, and pass model="),
    "trust_remote_code": _trainer("used by TRL only when it loads a model or tokenizer from a name"),
    "router_aux_loss_coef": _refused(
        lambda v: v is None or v == 0, "the MoE router loss is a per-rank token average, not reduced over the SP group",
        "leave router_aux_loss_coef=None"),
    "disable_dropout": _trainer("TRL zeroes dropout in the models; exactness needs it (keep True)"),
    "dataset_num_proc": _trainer(_TRL_DATA), "pad_token": _trainer(_TRL_DATA + "; its id pads the micro-batches"),
    "max_length": _refused(
        lambda v: v is None, "TRL would truncate every longer pair silently",
        "pass max_length=None (the cap is hf_longctx's max_tokens per micro-batch)"),
    "truncation_mode": _trainer("applies only with max_length, which must be None"),
    "padding_free": _refused(_falsy, _PACKED, "set padding_free=False"),
    "pad_to_multiple_of": _refused(
        lambda v: v in (None, "auto"), "micro-batches are padded by the SP layout, not by TRL's collator", "leave it 'auto' or None"),
    "precompute_ref_log_probs": _ours(
        "one SP reference pass over each train / eval dataset at construction (training/dpo/precompute.py), "
        "planned and packed as training; TRL's ref_chosen_logps / ref_rejected_logps columns, then no reference "
        "forward per step and the reference released"),
    "precompute_ref_batch_size": _refused(
        lambda v: v is None, "the reference pass packs pairs into micro-batches of max_tokens, as training does; "
        "a pair count per batch has no meaning there",
        "leave precompute_ref_batch_size=None (the pass's batches are max_tokens per SP group, tokens_per_step per step)"),
    "loss_type": _refused(
        _loss_type_ok, "only one of " + ", ".join(LOSS_TYPES) + " is implemented on per-document sums",
        "use loss_type='sigmoid' (TRL's default), 'hinge' or 'ipo', one at a time"),
    "loss_weights": _refused(lambda v: v is None, "weights apply to several loss types, which are refused",
                             "leave loss_weights=None with a single loss_type"),
    "ld_alpha": _refused(lambda v: v is None, "LD-DPO splits each completion's log-probs at the shorter completion's "
                         "length, which doc_sums does not", "leave ld_alpha=None"),
    "f_divergence_type": _refused(lambda v: str(getattr(v, "value", v)) == "reverse_kl",
                                  "only standard DPO (reverse KL) is implemented", "leave f_divergence_type='reverse_kl'"),
    "f_alpha_divergence_coef": _trainer("applies only with f_divergence_type='alpha_divergence', which is refused"),
    "label_smoothing": _trainer("TRL 1.16 applies it only to loss types refused here (robust, exo_pair, aot); "
                                "LongDPOTrainer ignores it as TRL does (dpo_loss's label_smoothing= is cDPO for loops)"),
    "beta": _ours("the DPO temperature"),
    "use_weighting": _refused(_falsy, "WPO weights are per-token averages not reduced over the SP group",
                              "leave use_weighting=False"),
    "discopop_tau": _trainer("applies only with loss_type='discopop', which is refused"),
    "activation_offloading": _refused(
        _falsy, "TRL's offloading wraps the forward outside the SP attention binding",
        "use patch(model, mesh, memory='max') (checkpointing with offloaded inputs, K/V offload)"),
    "sync_ref_model": _refused(_falsy, "TR-DPO's reference sync is not implemented with a sharded reference",
                               "leave sync_ref_model=False"),
    "ref_model_mixup_alpha": _trainer("applies only with sync_ref_model, which must be False"),
    "ref_model_sync_steps": _trainer("applies only with sync_ref_model, which must be False"),
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


def check_dpo_trainer(model: Any, args: Any, mesh: Any, kwargs: dict[str, Any]) -> None:
    """Everything LongDPOTrainer refuses, on every rank alike, before any collective."""
    from trl import DPOConfig

    if not isinstance(args, DPOConfig):
        refuse_dpo(f"args must be a trl.DPOConfig, got {type(args).__name__}", "pass args=DPOConfig(..., max_length=None)")
    check_dpo_config(args)
    if not isinstance(mesh, SPMesh):
        refuse_dpo(f"mesh must be an SPMesh (init_sequence_parallel), got {type(mesh).__name__}",
                "use a fixed-degree mesh; flexible SP groups are not wired for pairs")
    for name in ("max_tokens_per_rank", "unequal_calls", "overlong"):
        if name in kwargs:
            refuse_dpo(f"{name} is not supported", "pairs are never split or truncated; use max_tokens with an SPMesh")
    check_patched(model, mesh)
    check_logprob_head(model)  # the chunked LM head's log-probabilities honour softcap and temperature only
    for name in ("peft_config", "quantization_config"):
        if kwargs.get(name) is not None:
            refuse_dpo(f"{name} is not supported ({name}={type(kwargs[name]).__name__})",
                    "train the full model (patch(model, mesh)); adapters are not sharded here")
    evals = kwargs.get("eval_dataset")
    evals = evals if isinstance(evals, dict) else {"eval_dataset": evals}
    for name, dataset in [("train_dataset", kwargs.get("train_dataset")), *evals.items()]:
        if dataset is not None:
            check_pair_dataset(dataset, name)
            if args.precompute_ref_log_probs:  # the rows the reference pass scores must be the rows trained
                stored_columns(dataset, name)
                check_fixed_rows(dataset, name)


def check_verify_option(count: Any, args: Any) -> None:
    """`verify_ref_logps`: a number of pairs >= 0, and only where stored columns are read."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"LongDPOTrainer: verify_ref_logps={count!r} is not a number of pairs. Do instead: pass how "
                         "many pairs to rescore, e.g. verify_ref_logps=64, or 0 to rescore none")
    if count and not args.precompute_ref_log_probs:
        refuse_dpo(f"verify_ref_logps={count} with precompute_ref_log_probs=False: stored reference columns are then "
                   "not read (the reference runs on every step), so there is nothing to verify",
                   "set DPOConfig(precompute_ref_log_probs=True) to train on the stored columns, or drop verify_ref_logps")


def check_pair_dataset(dataset: Any, name: str) -> None:
    from datasets import Dataset

    if not isinstance(dataset, Dataset) or len(dataset) == 0:
        refuse_dpo(f"{name} must be a non-empty datasets.Dataset, got {type(dataset).__name__}",
                "Dataset.from_list([{'prompt': [ids], 'chosen': [ids], 'rejected': [ids]}, ...])")
    if pair_format(dataset[0]) == "unknown" or any(k in dataset.column_names for k in ("image", "images")):
        refuse_dpo(f"{name} columns {dataset.column_names} are not preference pairs",
                "give prompt/chosen/rejected token-id lists, TRL's prompt_ids/chosen_ids/rejected_ids, or "
                "TRL's text / conversational prompt/chosen/rejected (tokenized by TRL)")
