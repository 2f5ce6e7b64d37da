"""`LongDPOTrainer`: TRL's `DPOTrainer` made exact under sequence parallelism (issue 21, item 2).

Where it sits: on top of the whole data flow, like `LongContextTrainerMixin` (trainer.py), whose
overrides it inherits (FSDP2 over DP x SP with sum reduction, the logged global loss, the true
grad_norm, checkpoints). What differs from token-level training is the unit and the objective:
- data (dpo_steps.py): a step is a global list of preference PAIRS drawn alike on every rank;
  `plan_pairs` keeps the chosen and rejected completions of a pair in one micro-batch of one SP
  group, `pack_pairs` + `shard_batch` make the shards;
- loss (`compute_loss`): the policy's per-document log-prob sums (`completion_logps`, i.e.
  `distributed/doc_sums.py`, reduced over the SP group), the reference's on the same shard under
  no_grad (TRL's default reference: the initial model loaded again from its path; or the user's
  `ref_model`; patched with the same mesh, FSDP2-sharded over DP x SP like the policy), then
  `dpo_loss`: Σ per-pair losses / (GLOBAL pairs of the step x sp) -- so the sum over ranks and
  micro-batches is TRL's per-batch mean over all the step's pairs, and the summed gradients
  are its gradients;
- metrics (`training_step`): TRL's rewards/chosen, rewards/rejected, rewards/accuracies,
  rewards/margins, logps/chosen, logps/rejected as GLOBAL means (sums all-reduced over DP, /
  global pairs; SP ranks hold the same sums), num_tokens, and TRL's token metrics entropy,
  logits/chosen, logits/rejected, mean_token_accuracy as global token means
  (`dpo_loss.token_metric_sums`).

Refused at construction, before any collective: every DPOConfig value `check_dpo_config` refuses
(dpo_arguments.py), PEFT / quantization (`peft_config`, `quantization_config`), a `GroupBank`
and datasets that are not preference pairs. Evaluation (`evaluate`) runs the same sharded
forward under no_grad: eval_loss is the mean per-pair loss of the whole eval set and the
eval metrics are global means over it (TRL averages per-batch means: equal when batches are).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from trl import DPOTrainer

from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.errors import NotSupported
from hf_longctx.integrations.accelerate import fsdp_plan
from hf_longctx.integrations.transformers import is_patched, patch, patch_state
from hf_longctx.training.construction import check_patched
from hf_longctx.training.dpo_arguments import check_dpo_config
from hf_longctx.training.dpo_loss import TOKEN_SUMS, completion_logps, dpo_loss, token_metric_sums
from hf_longctx.training.dpo_steps import (
    PAIR_COLUMNS, PAIRS_KEY, PairStepCollate, pair_format, pair_lengths, pair_rows, pair_step_dataloader,
)
from hf_longctx.training.trainer import LongContextTrainerMixin

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")
_NOT_MODEL_INPUTS = ("labels", "num_items_in_batch", PAIRS_KEY)


def _refuse(what: str, instead: str) -> None:
    raise NotSupported(f"LongDPOTrainer: {what}", instead)


def check_dpo_trainer(model: Any, args: Any, mesh: Any, kwargs: dict[str, Any]) -> None:
    """Everything LongDPOTrainer refuses, on every rank alike, before any collective."""
    from trl import DPOConfig

    if not isinstance(args, DPOConfig):
        _refuse(f"args must be a trl.DPOConfig, got {type(args).__name__}", "pass args=DPOConfig(..., max_length=None)")
    check_dpo_config(args)
    if not isinstance(mesh, SPMesh):
        _refuse(f"mesh must be an SPMesh (init_sequence_parallel), got {type(mesh).__name__}",
                "use a fixed-degree mesh; flexible SP groups are not wired for pairs")
    check_patched(model, mesh)
    knobs = patch_state(model).options
    if getattr(knobs, "loss_chunks", None):
        _refuse(f"patch(loss_chunks={knobs.loss_chunks}) drops the logits the DPO log-probs need",
                "patch the policy without loss_chunks")
    for name in ("peft_config", "quantization_config"):
        if kwargs.get(name) is not None:
            _refuse(f"{name} is not supported ({name}={type(kwargs[name]).__name__})",
                    "train the full model (patch(model, mesh)); adapters are not sharded here")
    evals = kwargs.get("eval_dataset")
    evals = evals if isinstance(evals, dict) else {"eval_dataset": evals}
    for name, dataset in [("train_dataset", kwargs.get("train_dataset")), *evals.items()]:
        if dataset is not None:
            check_pair_dataset(dataset, name)


def check_pair_dataset(dataset: Any, name: str) -> None:
    from datasets import Dataset

    if not isinstance(dataset, Dataset) or len(dataset) == 0:
        _refuse(f"{name} must be a non-empty datasets.Dataset, got {type(dataset).__name__}",
                "Dataset.from_list([{'prompt': [ids], 'chosen': [ids], 'rejected': [ids]}, ...])")
    if pair_format(dataset[0]) == "unknown" or any(k in dataset.column_names for k in ("image", "images")):
        _refuse(f"{name} columns {dataset.column_names} are not preference pairs",
                "give prompt/chosen/rejected token-id lists, TRL's prompt_ids/chosen_ids/rejected_ids, or "
                "TRL's text / conversational prompt/chosen/rejected (tokenized by TRL)")


def default_reference(model: Any, mesh: SPMesh, trust_remote_code: bool) -> Any:
    """TRL's default reference (`ref_model=None`): the model loaded again from its path, in the
    policy's dtype, patched with the same mesh and memory knobs (no checkpointing: no backward)."""
    from trl.trainer.utils import create_model_from_path, get_config_model_id

    ref = create_model_from_path(get_config_model_id(model.config), dtype=model.dtype, trust_remote_code=trust_remote_code)
    return reference_on_mesh(ref, model, mesh)


def reference_on_mesh(ref: Any, model: Any, mesh: SPMesh) -> Any:
    """`ref` patched like the policy (same mesh, same kv_offload / mlp_chunks), frozen."""
    if is_patched(ref):
        state = patch_state(ref)
        if state.bank is not None or state.mesh != mesh:
            raise ValueError("ref_model was patched with a different mesh than the trainer's `mesh`")
    else:
        policy = patch_state(model)
        options = policy.options
        ref = patch(ref, mesh, kv_offload=options.kv_offload, mlp_chunks=options.mlp_chunks, mixers=policy.mixers_option)
    return ref.eval().requires_grad_(False)


class LongDPOTrainer(LongContextTrainerMixin, DPOTrainer):
    """TRL's `DPOTrainer` with exact sequence-parallel training of preference pairs.

    `LongDPOTrainer(model=patch(model, mesh), args=DPOConfig(..., max_length=None),
    train_dataset=pairs, processing_class=tokenizer, mesh=mesh, max_tokens=..., tokens_per_step=...)`:
    every optimizer step trains the pairs that fill `tokens_per_step` tokens (chosen and rejected
    documents counted), each micro-batch of an SP group holds at most `max_tokens`. Keyword
    arguments only. `ref_model`: None (TRL's default, the initial model from its path) or a model
    (patched here with the mesh if it is not). The other keyword arguments: `LongContextTrainerMixin`'s
    (`cost`, `strategy`, `pad_token_id`, `step_timeout_s`, `peak_flops`, `sync_each_microbatch`,
    `param_offload`) and DPOTrainer's.
    """

    def __init__(self, *, model: Any, ref_model: Any = None, args: Any = None, mesh: SPMesh, **kwargs: Any) -> None:
        check_dpo_trainer(model, args, mesh, kwargs)  # before any collective, on every rank alike
        for name in ("max_tokens_per_rank", "unequal_calls", "overlong"):
            if name in kwargs:
                _refuse(f"{name} is not supported", "pairs are never split or truncated; use max_tokens with an SPMesh")
        if ref_model is None:
            ref_model = default_reference(model, mesh, args.trust_remote_code)
        elif ref_model is model:
            raise ValueError("model and ref_model must be different objects: leave ref_model=None for TRL's default copy")
        else:
            ref_model = reference_on_mesh(ref_model, model, mesh)
        super().__init__(model=model, ref_model=ref_model, args=args, mesh=mesh, **kwargs)
        if mesh.world_size > 1:  # ZeRO-3 like the policy: forward-only all-gathers, no replica per rank
            fsdp_plan(self.ref_model, mesh, mixed_precision="bf16" if self.args.bf16 else "fp32",
                      param_offload=self.param_offload).apply(self.ref_model)
        self._token_stats = None  # TRL's token metrics come from token_metric_sums (step_loop's TokenStats unused)
        self._pair_collate = PairStepCollate(
            mesh, self.max_tokens, cost=self.collator.cost, strategy=self.collator.strategy,
            pad_token_id=self.collator.pad_token_id, flops_model=self._flops_model, vocab=self.collator.vocab)
        self._dpo_sums = torch.zeros(len(METRICS) + len(TOKEN_SUMS), dtype=torch.float64, device=self.args.device)

    # ---- data: TRL's tokenized pairs, planned by pairs (dpo_steps.py) ----------------------------------
    def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, dataset_name: str) -> Any:
        kind = pair_format(next(iter(dataset)))
        if kind == "ids":
            return pair_rows(dataset)
        if kind == "trl":  # text / conversational: TRL's own tokenization, unchanged
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        return dataset  # "tokenized" (TRL's own output form); "unknown" was refused before

    def _check_train_data(self, overlong: str, vocab: Any = None) -> list[int]:
        return self._pair_lengths(self.train_dataset, "train_dataset")

    def _pair_lengths(self, dataset: Any, name: str) -> list[int]:
        """Tokens of every pair (both documents), each pair checked against max_tokens."""
        chosen, rejected = pair_lengths(dataset, name)
        mesh, cap = self.mesh, self.max_tokens
        units = [-(-c // mesh.doc_multiple) * mesh.doc_multiple + -(-r // mesh.doc_multiple) * mesh.doc_multiple
                 for c, r in zip(chosen, rejected)]
        long = [(i, n) for i, n in enumerate(units) if n > cap]
        if long:
            i, n = long[0]
            raise ValueError(f"{name}: {len(long)} pair(s) exceed max_tokens={cap} (pair {i} holds {n} tokens, "
                             "chosen and rejected padded): a pair is never split; raise max_tokens or drop long pairs")
        return [c + r for c, r in zip(chosen, rejected)]

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        loader, self._step_sampler = pair_step_dataloader(
            self.train_dataset.select_columns(list(PAIR_COLUMNS)), self._pair_collate,
            tokens_per_step=self.tokens_per_step, seed=seed, shuffle=True, lengths=self._train_lengths)
        return loader

    def get_eval_dataloader(self, eval_dataset: Any = None) -> torch.utils.data.DataLoader:
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("LongDPOTrainer: evaluation requires an eval_dataset")
        check_pair_dataset(dataset, "eval_dataset")
        loader, _ = pair_step_dataloader(
            dataset.select_columns(list(PAIR_COLUMNS)), self._pair_collate, tokens_per_step=self.tokens_per_step,
            seed=self.args.seed, shuffle=False, lengths=self._pair_lengths(dataset, "eval_dataset"), endless=False,
            name="eval_dataset")
        return loader

    def evaluation_loop(self, dataloader: Any, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> Any:
        # The mixin's loop (evaluation.py): Σ (micro-batch loss share x step pairs) over ranks / Σ pairs,
        # i.e. the mean per-pair loss of the eval set; the metric sums cover the whole set.
        self._dpo_sums.zero_()
        out = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        self._record_metrics("eval", out.metrics[f"{metric_key_prefix}_targets"], 0)
        return out

    # ---- the step: DPO on per-document sums, metrics as global means ----------------------------------
    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        if return_outputs:
            _refuse("compute_loss(return_outputs=True)", "use the logged metrics")
        kwargs = {k: v for k, v in inputs.items() if k not in _NOT_MODEL_INPUTS}
        mesh, empty = self.mesh, inputs[PAIRS_KEY] == 0
        with torch.no_grad():  # every slot, empty ones too: the sharded reference all-gathers per unit
            ref_logits = self.ref_model(**kwargs).logits  # [1, S_local, V]
            reference = None if empty else completion_logps(ref_logits, inputs, mesh)[0]  # [2P], every SP rank
            del ref_logits
        if hasattr(self.ref_model, "reshard"):  # FSDP2 keeps the root unsharded after forward (for a backward)
            self.ref_model.reshard()
        logits = model(**kwargs).logits  # [1, S_local, V]
        if empty:  # an empty slot: the forwards join FSDP's collectives, no loss
            return logits.sum() * 0.0
        policy, counts = completion_logps(logits, inputs, mesh)  # [2P] each, every SP rank
        # TRL 1.16 applies label_smoothing to none of the loss types dpo_loss implements.
        pairs = num_items_in_batch if num_items_in_batch is not None else inputs["num_items_in_batch"]  # the step's
        loss, sums = dpo_loss(policy, reference, beta=self.beta, loss_type=self.loss_types[0],
                              global_pairs=int(pairs), sp=mesh.sp, counts=counts)
        sums = {**sums, "logps/chosen": policy[0::2].detach().sum(), "logps/rejected": policy[1::2].detach().sum()}
        pair_sums = torch.stack([sums[k].double() for k in METRICS]).to(self._dpo_sums.device)  # [6]
        token_sums = token_metric_sums(logits.detach(), inputs, mesh).to(self._dpo_sums.device)  # [7]
        self._dpo_sums += torch.cat([pair_sums, token_sums])
        return loss

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        self._dpo_sums.zero_()
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._record_metrics("train", inputs["num_items_in_batch"], inputs["tokens"])
        return loss

    def _record_metrics(self, mode: str, pairs: int, tokens: int) -> None:
        """TRL's per-step metrics over the step's global pairs and tokens (one DP all-reduce)."""
        sums = self._dpo_sums.clone()
        if self.mesh.dp > 1:
            dist.all_reduce(sums, group=self.mesh.dp_group)  # [13]: Σ over DP groups (SP ranks hold equal sums)
        values = sums.tolist()
        for key, value in zip(METRICS, values):
            self._metrics[mode][key].append(value / pairs)
        t = dict(zip(TOKEN_SUMS, values[len(METRICS):]))
        ratio = lambda a, b: a / b if b > 0 else 0.0  # noqa: E731 (TRL's 0.0 for an empty count)
        self._metrics[mode]["entropy"].append(ratio(t["entropy"], t["tokens"]))
        self._metrics[mode]["logits/chosen"].append(ratio(t["logits/chosen"], t["chosen_tokens"]))
        self._metrics[mode]["logits/rejected"].append(ratio(t["logits/rejected"], t["rejected_tokens"]))
        self._metrics[mode]["mean_token_accuracy"].append(ratio(t["top1/chosen"], t["chosen_tokens"]))
        if mode == "train":
            self._total_train_tokens += tokens  # both documents of every pair of the step, once
            self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
