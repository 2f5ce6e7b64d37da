"""The DPO trainer's data: preference-pair rows -> one `StepBatch` of THIS rank per optimizer step.

Where it sits: between `LongDPOTrainer`'s train dataset and its `training_step`, in place of
`sft/data.py`'s document pipeline. Every rank draws the SAME global list of pairs per step
(invariant 8); `plan_pairs` assigns whole pairs to DP ranks and micro-batches, `pack_pairs`
lays them out and `shard_batch` takes this SP rank's tokens. Guarantees: the step's
`num_items_in_batch` is its GLOBAL pair count; each micro-batch carries its pair count under
`PAIRS_KEY` (0: an empty slot, one padding token, still run so every rank joins every
collective) and, when the rows carry TRL's stored reference sums, those of its pairs under
`REF_KEY` (rows whose ids no longer match the sums' fingerprint are refused first). Rows
are TRL's tokenized form (`prompt_ids`, `chosen_ids`, `rejected_ids`), which `pair_rows`
makes from `prompt` / `chosen` / `rejected` id lists."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from hf_longctx.data.pairs import pack_pairs, plan_pairs
from hf_longctx.data.sampler import StepSampler
from hf_longctx.data.sharding import IGNORE_INDEX, shard_batch
from hf_longctx.data.token_ids import Vocabulary, check_token_ids, document_name
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.training.base.step_data import FeatureRows, StepBatch, StepStream
from hf_longctx.training.dpo.ref_columns import IDS_HASH, REF_COLUMNS, REF_KEY, check_rows_scored

PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
ID_COLUMNS = ("prompt", "chosen", "rejected")
PAIRS_KEY = "dpo_pairs"  # pairs of a micro-batch (not a model input)


def _is_ids(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def pair_format(example: dict[str, Any]) -> str:
    """"tokenized" (TRL's prompt_ids/chosen_ids/rejected_ids), "ids" (prompt/chosen/rejected
    id lists), "trl" (text or conversational prompt/chosen/rejected: TRL tokenizes it), or
    "unknown"."""
    if all(c in example for c in PAIR_COLUMNS):
        return "tokenized"
    if "chosen" in example and "rejected" in example:
        if all(_is_ids(example.get(c, [])) for c in ID_COLUMNS):
            return "ids"
        if all(isinstance(example.get(c, ""), (str, list)) for c in ID_COLUMNS):
            return "trl"
    return "unknown"


def pair_rows(dataset: Any) -> Any:
    """A dataset of prompt/chosen/rejected token-id lists -> TRL's tokenized columns."""
    if "prompt" not in dataset.column_names:
        raise ValueError("token-id preference pairs need a 'prompt' column (an empty list for no prompt)")
    keep = [c for c in dataset.column_names if c not in ID_COLUMNS]
    return dataset.select_columns(list(ID_COLUMNS) + keep).rename_columns(
        {"prompt": "prompt_ids", "chosen": "chosen_ids", "rejected": "rejected_ids"})


def pair_lengths(dataset: Any, name: str = "train_dataset") -> tuple[list[int], list[int]]:
    """(prompt+chosen, prompt+rejected) token counts of every pair; raises naming the first
    pair with an empty completion (nothing to score)."""
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")
    p, c, r = (pc.list_value_length(table[col]).to_pylist() for col in PAIR_COLUMNS)
    empty = [i for i in range(len(p)) if not c[i] or not r[i]]
    if empty:
        raise ValueError(f"{name}: pair {empty[0]} has an empty completion ({len(empty)} such pairs): drop them")
    return [a + b for a, b in zip(p, c)], [a + b for a, b in zip(p, r)]


class PairStepCollate:
    """collate_fn: one step's pair rows -> this rank's `StepBatch` (see the module docstring)."""

    def __init__(self, mesh: SPMesh, max_tokens: int, *, cost: Any = None, strategy: str = "balanced",
                 pad_token_id: int = 0, flops_model: Any = None, vocab: Vocabulary | None = None) -> None:
        self.mesh, self.max_tokens, self.cost, self.strategy = mesh, max_tokens, cost, strategy
        self.pad_token_id, self.flops_model, self.vocab = pad_token_id, flops_model, vocab

    def _check_ids(self, rows: Sequence[dict[str, Any]]) -> None:
        """Every pair's two documents against the model's vocabulary, on the host, before any
        collective (`token_ids.py`): every rank holds the step's whole list and raises alike."""
        for i, row in enumerate(rows):
            where = document_name(row, i)
            prompt = list(row["prompt_ids"])
            for side in ("chosen", "rejected"):
                ids = torch.as_tensor(prompt + list(row[f"{side}_ids"]), dtype=torch.long)  # [L] prompt + completion
                check_token_ids(ids, None, self.vocab, f"{where} (prompt + {side})")

    def _empty(self, pairs: int) -> dict[str, Any]:
        one = {"input_ids": torch.tensor([[self.pad_token_id]]), "labels": torch.tensor([[IGNORE_INDEX]]),
               "position_ids": torch.tensor([[0]])}  # [1, 1]: shard_batch pads it to the layout multiples
        return {**shard_batch(one, self.mesh, pairs, pad_token_id=self.pad_token_id), PAIRS_KEY: 0}

    def __call__(self, rows: Sequence[dict[str, Any]]) -> StepBatch:
        if self.vocab is not None:
            self._check_ids(rows)
        stored = bool(rows) and all(c in rows[0] for c in REF_COLUMNS)
        if rows and IDS_HASH in rows[0]:
            check_rows_scored(rows)  # the ids the stored reference sums were computed on
        chosen = [len(x["prompt_ids"]) + len(x["chosen_ids"]) for x in rows]
        rejected = [len(x["prompt_ids"]) + len(x["rejected_ids"]) for x in rows]
        mesh = self.mesh
        plan = plan_pairs(chosen, rejected, dp_size=mesh.dp, max_tokens=self.max_tokens, cost=self.cost,
                          strategy=self.strategy, doc_multiple=mesh.doc_multiple, seq_multiple=mesh.seq_multiple)
        micro_batches = []
        for mb in plan[mesh.dp_rank]:
            if not mb:
                micro_batches.append(self._empty(len(rows)))
                continue
            pairs = [tuple(list(rows[plan.pieces[i].doc][c]) for c in PAIR_COLUMNS) for i in mb]
            shard = shard_batch(pack_pairs(pairs), mesh, len(rows),
                                pad_token_id=self.pad_token_id)
            extra = {}
            if stored:  # [2P]: (chosen, rejected) of each pair, in pack_pairs' document order
                extra[REF_KEY] = torch.tensor([rows[plan.pieces[i].doc][c] for i in mb for c in REF_COLUMNS],
                                              dtype=torch.float32)
            micro_batches.append({**shard, PAIRS_KEY: len(mb), **extra})
        documents = [n for pair in zip(chosen, rejected) for n in pair]
        flops = float(self.flops_model(documents).sum()) if self.flops_model is not None else 0.0
        stats = plan.stats(self.cost) if self.cost is not None else {}
        return StepBatch(
            micro_batches=micro_batches,
            num_items_in_batch=len(rows),  # the step's GLOBAL pairs: the DPO loss is their mean
            tokens=int(sum(documents)), flops=flops, balance=stats.get("synced_over_ideal"),
            plan=plan, lengths=tuple(c + r for c, r in zip(chosen, rejected)), plan_stats=dict(stats),
        )


def pair_step_dataloader(dataset: Any, collate: PairStepCollate, *, tokens_per_step: int, seed: int, shuffle: bool,
                         lengths: Sequence[int], endless: bool = True,
                         name: str = "train_dataset") -> tuple[torch.utils.data.DataLoader, StepSampler]:
    """(DataLoader of step batches, its StepSampler): each step takes pairs until `tokens_per_step`
    (both documents of a pair counted) is reached; `endless` (training) runs into the next
    epoch like the train loader of sft/data.py, else one pass (evaluation)."""
    sampler = StepSampler(lengths, tokens_per_step=tokens_per_step, seed=seed, shuffle=shuffle)
    rows = FeatureRows(dataset, list(dataset.column_names), name, "pair")  # the columns the trainer selected
    loader = torch.utils.data.DataLoader(rows, batch_sampler=StepStream(sampler, endless=endless), collate_fn=collate,
                                         num_workers=0)
    return loader, sampler
