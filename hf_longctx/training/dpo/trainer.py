"""`LongDPOTrainer`: TRL's `DPOTrainer` made exact under sequence parallelism.

Where it sits: on top of the whole data flow; inherits `LongContextTrainerMixin`'s overrides
(FSDP2 with sum reduction, the global loss, the true grad_norm, checkpoints) and replaces the
unit and the objective: steps of preference PAIRS (`dpo/data.py`), `compute_loss` from the
policy's and the reference's per-document log-prob sums on the same shard (`dpo/loss.py`).
Guarantees: a step's loss and gradients are TRL's per-batch mean over all the step's pairs;
TRL's metrics are GLOBAL means (token metrics as global token means); evaluation's
eval_loss is the mean per-pair loss of the whole eval set. `precompute_ref_log_probs=True`:
one reference pass over each dataset at construction (`dpo/precompute.py`), then steps
without a reference forward and without the reference held. Refused before any collective:
what `check_dpo_config` refuses, PEFT / quantization, a `GroupBank`, non-pair datasets.
The design: docs/DESIGN.md "DPO under SP"."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from trl import DPOTrainer

from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.training.base.reference import default_reference, reference_on_mesh
from hf_longctx.training.refusals.dpo import (
    check_dpo_trainer, check_pair_dataset, check_verify_option, refuse_dpo,
)
from hf_longctx.integrations.logprob_head import token_logprobs
from hf_longctx.training.dpo.loss import TOKEN_STATS, TOKEN_SUMS, completion_sums, dpo_loss, stats_metric_sums
from hf_longctx.training.refusals.checks import check_materialised
from hf_longctx.training.dpo.data import (
    PAIR_COLUMNS, PAIRS_KEY, PairStepCollate, pair_format, pair_lengths, pair_rows, pair_step_dataloader,
)
from hf_longctx.training.dpo.model_digest import model_digest
from hf_longctx.training.dpo.precompute import reference_pass, with_ref_columns
from hf_longctx.training.dpo.ref_columns import (
    FINGERPRINT, IDS_HASH, REF_COLUMNS, REF_KEY, check_fixed_rows, stored_columns,
)
from hf_longctx.training.dpo.stored_ref import StoredRefColumns
from hf_longctx.training.sft.trainer import LongContextTrainerMixin

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")


class LongDPOTrainer(LongContextTrainerMixin, DPOTrainer):
    """TRL's `DPOTrainer` with exact sequence-parallel training of preference pairs.

    `LongDPOTrainer(model=patch(model, mesh), args=DPOConfig(..., max_length=None),
    train_dataset=pairs, processing_class=tokenizer, mesh=mesh, max_tokens=..., tokens_per_step=...)`:
    every optimizer step trains the pairs that fill `tokens_per_step` tokens (chosen and rejected
    documents counted), each micro-batch of an SP group holds at most `max_tokens`. Keyword
    arguments only. `mesh`: as `LongContextTrainerMixin`'s (or from `DPOConfig(parallelism_config=...)`).
    `ref_model`: None (TRL's default, the initial model from its path) or a model
    (patched here with the mesh if it is not). With `DPOConfig(precompute_ref_log_probs=True)`
    the reference scores every train / eval pair once at construction (ref_model=None: the
    policy itself, before any step, as TRL does; no copy is loaded) and is then released; the
    columns carry a fingerprint (the ids, the reference's digest, the sums), and a dataset given
    with them is checked against it at construction. A dataset given with TRL's columns but no
    fingerprint is used as given, with one warning; `verify_ref_logps`: how many sampled pairs
    of each such dataset the reference rescores at construction, refusing columns that
    disagree (0: none). The other keyword arguments: `LongContextTrainerMixin`'s
    (`cost`, `strategy`, `pad_token_id`, `step_timeout_s`, `peak_flops`, `sync_each_microbatch`,
    `param_offload`) and DPOTrainer's.

    Args:
        model: The policy, patched with `mesh` (`patch(model, mesh)`).
        ref_model: None (TRL's default, the initial model from its path) or a model
            (patched here with the mesh if it is not).
        args: A TRL `DPOConfig` with `max_length=None`.
        mesh: As `LongContextTrainerMixin`'s (or from `DPOConfig(parallelism_config=...)`).
        **kwargs: `max_tokens` and `tokens_per_step` (counting a pair's chosen and rejected
            documents together), `LongContextTrainerMixin`'s other keyword arguments, and
            `DPOTrainer`'s (`train_dataset`, `eval_dataset`, `processing_class`, ...).

    Raises:
        NotSupported: A refused `DPOConfig` field or combination, every value named.
    """

    def __init__(self, *, model: Any, ref_model: Any = None, args: Any = None, mesh: SPMesh | None = None,
                 verify_ref_logps: int = 0, **kwargs: Any) -> None:
        # mesh=, or the ParallelismConfig's (DPOConfig(parallelism_config=...) or the launcher's): base/mesh_source.py
        mesh, max_tokens = self._resolve_mesh(model, args, mesh, kwargs.get("max_tokens"))
        if max_tokens is not None:
            kwargs["max_tokens"] = max_tokens
        check_dpo_trainer(model, args, mesh, kwargs)  # every refusal on every rank alike, before the steps
        check_verify_option(verify_ref_logps, args)
        if ref_model is model:
            raise ValueError("model and ref_model must be different objects: leave ref_model=None for TRL's default copy")
        precompute = bool(args.precompute_ref_log_probs)
        self._reference_pass_ready = False  # TRL's __init__ asks for the pass before placement: run it below
        if precompute:  # the reference's digest, read before anything is sharded (every rank holds the full weights)
            self._stored_ref = StoredRefColumns(
                digest=model_digest(ref_model if ref_model is not None else model), verify=verify_ref_logps,
                reference="ref_model" if ref_model is not None else "the initial policy (ref_model=None)",
                seed=args.seed)
            self._check_given_columns(kwargs)
        if ref_model is None and not precompute:  # TRL's default: the policy loaded again from its path
            ref_model = default_reference(model, mesh, args.trust_remote_code)
        elif ref_model is not None:
            check_materialised(ref_model, "LongDPOTrainer", "ref_model")  # as the policy's, in _setup_mesh
            ref_model = reference_on_mesh(ref_model, model, mesh)
        super().__init__(model=model, ref_model=ref_model, args=args, mesh=mesh, **kwargs)
        if self.ref_model is not None:
            self._place_reference(self.ref_model)  # ZeRO-3 like the policy: forward-only all-gathers
        self._token_stats = None  # TRL's token metrics come from token_metric_sums (step_loop's TokenStats unused)
        self._pair_collate = PairStepCollate(
            mesh, self.max_tokens, cost=self.collator.cost, strategy=self.collator.strategy,
            pad_token_id=self.collator.pad_token_id, flops_model=self._flops_model, vocab=self.collator.vocab)
        self._dpo_sums = torch.zeros(len(METRICS) + len(TOKEN_SUMS), dtype=torch.float64, device=self.args.device)
        self._reference_released = False
        if precompute:
            self._precompute_all()

    # ---- precompute_ref_log_probs: one reference pass per dataset (dpo/precompute.py) ---------------
    def _check_given_columns(self, kwargs: dict[str, Any]) -> None:
        """Before TRL's preparation and any collective: the fingerprint of every given dataset that
        is already tokenized and carries stored columns (the others are checked once prepared)."""
        evals = kwargs.get("eval_dataset")
        evals = evals if isinstance(evals, dict) else {"eval_dataset": evals}
        for name, dataset in [("train_dataset", kwargs.get("train_dataset")), *evals.items()]:
            if dataset is not None and stored_columns(dataset, name) and pair_format(dataset[0]) == "tokenized":
                self._stored_ref.check(dataset, name)

    def _precompute_all(self) -> None:
        """The train and eval datasets with TRL's columns, then the reference released: its
        sharded weights (an explicit ref_model) leave memory; with ref_model=None none was loaded."""
        self._reference_pass_ready = True
        if self.train_dataset is not None:
            self.train_dataset = self._precompute_ref_logps(self.train_dataset, "train", None)
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {k: self._precompute_ref_logps(v, k, None) for k, v in self.eval_dataset.items()}
        elif self.eval_dataset is not None:
            self.eval_dataset = self._precompute_ref_logps(self.eval_dataset, "eval", None)
        self._stored_ref.constructed()  # one warning for the datasets given with unverified columns
        self._reference_released = self.ref_model is not None
        self.ref_model = None

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: Any) -> Any:
        """TRL's hook (its `__init__` and `evaluate`): `dataset` with `ref_chosen_logps` /
        `ref_rejected_logps`, from the SP reference pass; a dataset carrying both is used as is,
        after its fingerprint's check, or a sample's rescoring (`stored_ref.py`).
        `batch_size` is unused: the pass packs pairs by `max_tokens` as training does."""
        if not self._reference_pass_ready:
            return dataset
        name = {"train": "train_dataset", "eval": "eval_dataset"}.get(name, f"eval_dataset {name!r}")  # TRL's names
        held = not (self._reference_released or (self.ref_model is None and self.state.global_step > 0))
        reference = self.ref_model if self.ref_model is not None else self.model  # TRL's: the initial policy
        if stored_columns(dataset, name):
            score = (lambda pairs: self._reference_sums_of(reference, pairs, name)) if held else None
            self._stored_ref.accept(dataset, name, score=score, dtype=self._reference_dtype(reference))
            return dataset
        check_pair_dataset(dataset, name)
        check_fixed_rows(dataset, name)
        if not held:
            refuse_dpo(f"{name} has no {REF_COLUMNS} and the reference is no longer held (precompute_ref_log_probs="
                       "True releases it after scoring the datasets given at construction)",
                       "pass this dataset as eval_dataset= when building the trainer, or add TRL's two columns to it")
        stale = [c for c in FINGERPRINT if c in dataset.column_names]  # a fingerprint left without its columns
        dataset = dataset.remove_columns(stale) if stale else dataset  # is rewritten with the new sums
        chosen, rejected = self._reference_sums_of(reference, dataset, name)
        return with_ref_columns(dataset, chosen, rejected, self._stored_ref.digest)

    def _reference_sums_of(self, reference: torch.nn.Module, pairs: Any,
                           name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference pass over `pairs`: (fp32 [N] chosen sums, fp32 [N] rejected sums), every rank alike."""
        return reference_pass(reference, pairs, self._pair_collate, self.mesh, lengths=self._pair_lengths(pairs, name),
                              tokens_per_step=self.tokens_per_step, device=self.args.device)

    def _reference_dtype(self, reference: torch.nn.Module) -> torch.dtype:
        """The dtype the reference computes in (what bounds a rescoring's rounding)."""
        if self.args.bf16 or self.args.fp16:
            return torch.bfloat16 if self.args.bf16 else torch.float16
        return next((p.dtype for p in reference.parameters() if p.is_floating_point()), torch.float32)

    def _columns(self, dataset: Any, name: str) -> list[str]:
        """The columns a step reads: the pairs, and TRL's stored sums under precompute_ref_log_probs
        (a dataset set after construction is checked here, before the first step's collectives)."""
        if not self.precompute_ref_logps:
            return list(PAIR_COLUMNS)
        if not stored_columns(dataset, name):
            refuse_dpo(f"{name} has no {REF_COLUMNS} columns (precompute_ref_log_probs=True)",
                       "give the trainer this dataset at construction (the reference pass adds them)")
        check_fixed_rows(dataset, name)
        if not self._stored_ref.check(dataset, name):
            self._stored_ref.unverified(dataset, name)
        return list(PAIR_COLUMNS) + list(REF_COLUMNS) + ([IDS_HASH] if IDS_HASH in dataset.column_names else [])

    # ---- data: TRL's tokenized pairs, planned by pairs (dpo/data.py) ----------------------------------
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
        loader, self.step_sampler = pair_step_dataloader(
            self.train_dataset.select_columns(self._columns(self.train_dataset, "train_dataset")), self._pair_collate,
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
            dataset.select_columns(self._columns(dataset, "eval_dataset")), self._pair_collate,
            tokens_per_step=self.tokens_per_step,
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
            refuse_dpo("compute_loss(return_outputs=True)", "use the logged metrics")
        shard = {k: v for k, v in inputs.items() if k not in (PAIRS_KEY, REF_KEY)}  # token_logprobs: no labels
        mesh, empty = self.mesh, inputs[PAIRS_KEY] == 0
        if self.precompute_ref_logps:  # TRL's stored columns, [2P] (absent in an empty slot)
            reference = inputs.get(REF_KEY)
        else:
            reference = self._reference_sums(shard, inputs, empty)
        token, stats = token_logprobs(model, shard, stats=TOKEN_STATS)  # [1, S_local], [1, S_local, 3]
        if empty:  # an empty slot: the forwards join FSDP's collectives, no loss
            return token.sum() * 0.0
        policy, counts = completion_sums(token, inputs, mesh)  # [2P] each, every SP rank
        # TRL 1.16 applies label_smoothing to none of the loss types dpo_loss implements.
        pairs = num_items_in_batch if num_items_in_batch is not None else inputs["num_items_in_batch"]  # the step's
        loss, sums = dpo_loss(policy, reference, beta=self.beta, loss_type=self.loss_types[0],
                              global_pairs=int(pairs), sp=mesh.sp, counts=counts)
        sums = {**sums, "logps/chosen": policy[0::2].detach().sum(), "logps/rejected": policy[1::2].detach().sum()}
        pair_sums = torch.stack([sums[k].double() for k in METRICS]).to(self._dpo_sums.device)  # [6]
        token_sums = stats_metric_sums(stats, inputs, mesh).to(self._dpo_sums.device)  # [7]
        self._dpo_sums += torch.cat([pair_sums, token_sums])
        return loss

    def _reference_sums(self, shard: dict[str, Any], inputs: dict[str, Any], empty: bool) -> torch.Tensor | None:
        """The reference's [2P] completion sums on this shard (None in an empty slot)."""
        with torch.no_grad():  # every slot, empty ones too: the sharded reference all-gathers per unit
            ref_token, _ = token_logprobs(self.ref_model, shard)  # [1, S_local] fp32, chunked LM head
            reference = None if empty else completion_sums(ref_token, inputs, self.mesh)[0]  # [2P], every SP rank
            del ref_token
        if hasattr(self.ref_model, "reshard"):  # FSDP2 keeps the root unsharded after forward (for a backward)
            self.ref_model.reshard()
        return reference

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        self._dpo_sums.zero_()
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._record_metrics("train", inputs.num_items_in_batch, inputs.tokens)
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
