"""The GRPO step's rows of one SP group -> several packed micro-batches, the same count on every rank.

Where it sits: `LongGRPOTrainer(max_tokens=...)`, after the SP group's rows are all-gathered
and before each micro-batch is packed with the step's GLOBAL counts N and T (so each
micro-batch's loss is its share of the one-batch loss). `plan_rows` plans by cost under
`max_tokens` (`plan_microbatches`, one DP rank), then agrees over the world with ONE MAX
all-reduce of [micro-batches, longest padded row]: every rank raises the same error for a
row that cannot fit, and a group that planned fewer than the largest count splits its
largest micro-batches, so every slot runs a real forward. `merge_metrics` weights token
means by each micro-batch's global completion tokens and takes nanmin / nanmax of the clip
ratios (`per_sequence` names: by its global completion count)."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.distributed as dist

from hf_longctx.data.packing import plan_microbatches
from hf_longctx.data.plan import ceil_to


def plan_rows(lengths: Sequence[int], mesh, max_tokens: int | None) -> list[list[int]]:
    """Row indices of each micro-batch of this SP group (`lengths`: prompt + completion tokens of
    the group's rows, the same list on every rank of the group). A collective over the world when
    `max_tokens` is set: call it on every rank once per step. None: one micro-batch of every row."""
    if max_tokens is None:
        return [list(range(len(lengths)))]
    cap = max_tokens // mesh.seq_multiple * mesh.seq_multiple
    padded = [ceil_to(int(n), mesh.doc_multiple) for n in lengths]
    longest = max(padded, default=0)
    bins: list[list[int]] = []
    if longest <= cap:
        plan = plan_microbatches(lengths, dp_size=1, max_tokens=max_tokens, doc_multiple=mesh.doc_multiple,
                                 seq_multiple=mesh.seq_multiple)
        bins = [sorted(plan.pieces[p].doc for p in mb) for mb in plan[0] if mb]
    agreed = torch.tensor([len(bins), longest], dtype=torch.int64)  # [2]: micro-batches, longest padded row
    if mesh.world_size > 1:
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=mesh.world_mesh.get_group())  # [2]: over every rank
    count, longest = int(agreed[0]), int(agreed[1])
    if longest > cap:  # the same values on every rank: all raise together, before any forward
        raise ValueError(f"a prompt+completion of {longest} tokens (padded to doc_multiple {mesh.doc_multiple}) does "
                         f"not fit max_tokens={max_tokens} (usable {cap} with seq_multiple {mesh.seq_multiple}); do "
                         f"instead: raise max_tokens to >= {ceil_to(longest, mesh.seq_multiple)}, or lower "
                         "max_completion_length / truncate prompts (max_prompt_length)")
    while len(bins) < count:  # split the largest splittable micro-batch: every slot keeps >= 1 row
        big = max((b for b in bins if len(b) > 1), key=lambda b: sum(padded[i] for i in b))
        bins.remove(big)
        half = math.ceil(len(big) / 2)
        bins += [big[:half], big[half:]]
    return bins


def slot_tokens(lengths: Sequence[int], bins: list[list[int]], mesh) -> list[float]:
    """Completion tokens of each micro-batch slot over the whole world (`lengths`: completion
    tokens of this group's rows). One SUM all-reduce: every rank of an SP group adds its group's
    count, so the sum is divided by sp."""
    counts = torch.tensor([float(sum(lengths[i] for i in b)) for b in bins], dtype=torch.float64)  # [K]
    if mesh.world_size > 1:
        dist.all_reduce(counts, group=mesh.world_mesh.get_group())  # [K]: Σ over every rank = sp x Σ over groups
        counts = counts / mesh.sp
    return counts.tolist()


def merge_metrics(parts: list[dict[str, float]], tokens: list[float], *, sequences: list[float] | None = None,
                  per_sequence: Sequence[str] = ()) -> dict[str, float]:
    """The step's metrics from each micro-batch's (the loss's, global over the world): token means
    weighted by each slot's global completion-token count, the names in `per_sequence` (means over
    completions) by each slot's global completion count `sequences`, clip extremes as nanmin / nanmax."""
    if len(parts) == 1:
        return parts[0]
    out: dict[str, Any] = {}
    for name in parts[0]:
        values = [p[name] for p in parts]
        if name == "clip_ratio/low_min" or name == "clip_ratio/high_max":
            real = [v for v in values if not math.isnan(v)]
            out[name] = (min(real) if name.endswith("min") else max(real)) if real else float("nan")
        else:
            counts = sequences if name in per_sequence and sequences is not None else tokens
            out[name] = sum(v * c for v, c in zip(values, counts)) / max(sum(counts), 1.0)
    return out
