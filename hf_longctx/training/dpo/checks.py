"""What `LongDPOTrainer` refuses at construction, beyond its `DPOConfig` table.

Where it sits: at the start of `LongDPOTrainer.__init__` (and for every dataset a step or
`evaluate` reads), on every rank alike, before any collective. `refusals/dpo.py` holds the
`DPOConfig` table and `refuse_dpo`, the one form of a DPO refusal; the checks here need the
DPO trainer's own data rules (`dpo/data.pair_format`, the stored columns of
`dpo/ref_columns.py`), so they sit in `dpo/`, above the refusal tables, and import them.
Guarantees: a mesh other than an `SPMesh`, options that split or truncate pairs, adapters,
quantized loading, datasets that are not preference pairs, and stored reference columns on
rows that may change are refused naming the value and what to do instead.
"""

from __future__ import annotations

from typing import Any

from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.distributed.mesh_protocol import Mesh
from hf_longctx.integrations.logprob_head import check_logprob_head
from hf_longctx.training.dpo.data import pair_format
from hf_longctx.training.dpo.ref_columns import check_fixed_rows, stored_columns
from hf_longctx.training.refusals.checks import check_patched
from hf_longctx.training.refusals.dpo import check_dpo_config, refuse_dpo


def check_dpo_trainer(model: Any, args: Any, mesh: Mesh, kwargs: dict[str, Any]) -> None:
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
    check_logprob_head(model)  # what the model does to its logits after the head is read (logit_maps)
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
