"""The flexible step driver: run one planned step, slot by slot, each on its own SP group.

Where it sits: between the flexible planner (a `FlexPlan`) and the model patched with a
`GroupBank`. For each slot it shards the group's documents with `shard_batch(batch,
bank.mesh(size))` (the group travels in `SPBatchInfo.group`, so attention and recompute
run on it) and runs forward + backward; `run_flex_step` / `flex_microbatches` per step.
Guarantees: losses are divided by the step's GLOBAL valid-label count and gradients SUMMED
over the world (invariant 6, unchanged by grouping); a plan that breaks `validate` or
differs between ranks (one fingerprint all-reduce) is refused before the first forward;
with unequal calls an FSDP2 model runs the step unsharded (`flex/unsharded_step.py`)."""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from hf_longctx.flex.plan import FlexGroup, FlexPlan
from hf_longctx.data.padding import MASK_KEY, real_span
from hf_longctx.data.sharding import IGNORE_INDEX, shard_batch
from hf_longctx.flex.bank import GroupBank
from hf_longctx.distributed.loss import collective_device, global_loss
from hf_longctx.flex.unsharded_step import check_unsharded_step, unsharded_step


def check_plan(plan: FlexPlan, bank: GroupBank) -> None:
    """Pure checks (raise the same ValueError on every rank, before any collective)."""
    if not isinstance(plan, FlexPlan):
        raise TypeError(f"plan must be a FlexPlan from plan_flexible/plan_fixed, got {type(plan).__name__}")
    if plan.world_size != bank.world_size:
        raise ValueError(f"the plan is for {plan.world_size} ranks but the group bank spans {bank.world_size}")
    for shape in plan.shapes:
        if shape not in bank.shapes:
            raise ValueError(
                f"the plan uses group shape {shape} which the bank does not hold (bank: {list(bank.shapes)}); plan with "
                "shapes=bank.shapes"
            )
    # No plan.validate() here: a FlexPlan is frozen and validated when it is built.


def check_plan_agrees(plan: FlexPlan, bank: GroupBank) -> None:
    """One all-reduce of [fingerprint, -fingerprint] with MAX over the world: every rank
    learns whether all computed the same plan, and all raise together (no hang later)."""
    if bank.world_size == 1:
        return
    fp = plan.fingerprint()
    t = torch.tensor([fp, -fp], dtype=torch.long, device=collective_device(bank.world_mesh.get_group()))  # [2]
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=bank.world_mesh.get_group())  # [2]: max fp, -min fp
    hi, lo = int(t[0]), -int(t[1])
    if hi != fp or lo != fp:
        raise ValueError(
            f"ranks computed different flexible plans (fingerprints range over [{lo}, {hi}], this rank {fp}): every rank "
            "must plan from the same document list with the same settings"
        )


def _tokens(doc: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [L], unshifted labels [L]) int64 of one document: a mapping with
    `input_ids` (optional `labels`; a padded row's `attention_mask` keeps its real tokens only,
    `data/padding.py`), or a token sequence / tensor."""
    ids = doc["input_ids"] if isinstance(doc, Mapping) else doc
    labels = doc.get("labels") if isinstance(doc, Mapping) else None
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)  # [L]
    labels = ids if labels is None else torch.as_tensor(labels, dtype=torch.long).reshape(-1)  # [L]
    if len(labels) != len(ids) or not len(ids):
        raise ValueError(f"a document needs >= 1 token and labels of its length, got {len(ids)} ids, {len(labels)} labels")
    mask = doc.get(MASK_KEY) if isinstance(doc, Mapping) else None
    if mask is not None:
        mask = torch.as_tensor(mask).reshape(-1)  # [L]
        if len(mask) != len(ids):
            raise ValueError(f"a document's {MASK_KEY} has {len(mask)} entries but input_ids has {len(ids)}")
        start, end = real_span("a document", mask)
        ids, labels = ids[start:end], labels[start:end]  # [n]: the real tokens
    return ids, labels


def valid_labels(documents: Sequence[Any]) -> int:
    """Valid targets of the step once labels are shifted per document (`num_items_in_batch`)."""
    return sum(int((_tokens(d)[1][1:] != IGNORE_INDEX).sum()) for d in documents)


def group_batch(documents: Sequence[Any], group: FlexGroup, plan: FlexPlan, pad_token_id: int = 0) -> dict:
    """The packed row of one group's micro-batch (as DataCollatorWithFlattening makes it, HF
    unshifted labels); an empty group gets one padding document without targets, so its
    ranks still run the slot's forward/backward (their collectives must happen)."""
    docs = [_tokens(documents[d]) for d in group.docs]
    if not docs:
        n = plan.shape(group.size).seq_multiple
        docs = [(torch.full((n,), pad_token_id, dtype=torch.long), torch.full((n,), IGNORE_INDEX, dtype=torch.long))]
    return {
        "input_ids": torch.cat([i for i, _ in docs])[None],  # [1, S]
        "labels": torch.cat([lab for _, lab in docs])[None],  # [1, S]
        "position_ids": torch.cat([torch.arange(len(i)) for i, _ in docs])[None],  # [1, S]: restarts per document
    }


def flex_microbatches(
    plan: FlexPlan, bank: GroupBank, documents: Sequence[Any], *, num_items_in_batch: int | None = None, pad_token_id: int = 0
) -> Iterator[dict]:
    """This rank's shards, one per slot, ready for `model(**shard)` (checks first).

    Args:
        plan: The step's `FlexPlan` (the same on every rank).
        bank: This rank's `GroupBank`.
        documents: The step's documents, in the plan's order: each a mapping with
            `input_ids` (optional HF-unshifted `labels`; a padded row's `attention_mask`
            keeps its real tokens only), or a token sequence / tensor.
        num_items_in_batch: Valid targets of the whole step (default: counted from
            `documents`).
        pad_token_id: The id of padding tokens.

    Yields:
        One shard per slot of this rank (`shard_batch` on its group's mesh).

    Raises:
        ValueError: The plan does not match the bank or the documents' lengths, or the
            step has no valid target.
    """
    check_plan(plan, bank)
    if len(documents) != len(plan.lengths):
        raise ValueError(f"the plan covers {len(plan.lengths)} documents but {len(documents)} were given")
    lengths = [len(_tokens(d)[0]) for d in documents]
    if tuple(lengths) != plan.lengths:
        bad = [i for i, (a, b) in enumerate(zip(lengths, plan.lengths)) if a != b][:8]
        raise ValueError(f"documents {bad} have lengths {[lengths[i] for i in bad]}, the plan expects {[plan.lengths[i] for i in bad]}")
    total = valid_labels(documents) if num_items_in_batch is None else int(num_items_in_batch)
    if total < 1:
        raise ValueError("the step has no valid label (every document is one token or fully masked)")
    check_plan_agrees(plan, bank)
    for group in plan.for_rank(bank.rank):
        mesh = bank.mesh(group.size)
        yield shard_batch(group_batch(documents, group, plan, pad_token_id), mesh, num_items_in_batch=total,
                          pad_token_id=pad_token_id)


def run_flex_step(
    model: torch.nn.Module, bank: GroupBank, plan: FlexPlan, documents: Sequence[Any], *,
    num_items_in_batch: int | None = None, pad_token_id: int = 0, sync_each_microbatch: bool = False,
) -> torch.Tensor:
    """Forward + backward of every slot of `plan` on this rank.

    Gradients end summed over the world, ready for `optimizer.step()`.

    Args:
        model: The model patched with `bank`, optionally FSDP2-sharded over `bank.world`
            (`fsdp_plan(model, bank.world).apply(model)`).
        bank: This rank's `GroupBank`.
        plan: The step's `FlexPlan` (the same on every rank).
        documents: The step's documents, in the plan's order: each a mapping with
            `input_ids` (optional HF-unshifted `labels`; a padded row's `attention_mask`
            keeps its real tokens only), or a token sequence / tensor.
        num_items_in_batch: Valid targets of the whole step (default: counted from
            `documents`).
        pad_token_id: The id of padding tokens.
        sync_each_microbatch: With FSDP2 and equal counts, reduce-scatter in every
            backward (gradients accumulate sharded; more traffic) instead of only in the
            last (the default, which holds the fp32 unsharded gradients through the step:
            `capacity/estimate.py`).

    Returns:
        The step's global mean loss (the same on every rank), detached.

    Raises:
        ValueError: `sync_each_microbatch` with unequal counts, or the plan does not match
            the bank or the documents.
    """
    from torch.distributed.fsdp import FSDPModule

    if sync_each_microbatch and not plan.equal_calls:
        raise ValueError("sync_each_microbatch=True needs equal micro-batch counts: with unequal counts every rank syncs "
                         "in its own last backward (the reduce-scatters must pair up across ranks)")
    fsdp = isinstance(model, FSDPModule)
    device = next(model.parameters()).device  # a DTensor parameter's device is its local shard's
    local = torch.zeros((), dtype=torch.float64, device=device)  # Σ this rank's micro-batch losses
    shards = [
        {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in shard.items()}  # metadata stays as is
        for shard in flex_microbatches(plan, bank, documents, num_items_in_batch=num_items_in_batch,
                                       pad_token_id=pad_token_id)
    ]  # checks and the fingerprint first
    n = len(shards)
    if plan.equal_calls or not fsdp:
        for j, shard in enumerate(shards):
            if fsdp:
                model.set_requires_gradient_sync(sync_each_microbatch or j == n - 1)  # default: one reduce-scatter per step
            loss = model(**shard).loss
            loss.backward()
            local += loss.detach().double()
    else:  # unequal counts: parameters unsharded for the step, each rank syncs in its own last backward
        check_unsharded_step(model, bank.world_mesh.get_group())
        with unsharded_step(model, n) as before_backward:
            for j, shard in enumerate(shards):
                loss = model(**shard).loss
                before_backward(j)
                loss.backward()
                local += loss.detach().double()
    if not fsdp and bank.world_size > 1:
        from hf_longctx.distributed.loss import sum_gradients

        sum_gradients([p for p in model.parameters() if p.requires_grad], bank.world)
    return global_loss(local, bank.world).float()  # []: shares of every rank and slot sum to the mean
