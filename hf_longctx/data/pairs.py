"""Preference pairs as planning units and packed rows (DPO).

Where it sits: before `shard_batch`. A DPO loss needs a pair's chosen and rejected
completions in the same micro-batch and SP group (training/dpo/loss.py). `plan_pairs` is a
thin layer over `plan_microbatches` with each pair ONE unit of its two padded documents,
so a pair is never separated (one that cannot fit raises; never split or truncated); its
cost c + r over-estimates attention's c² + r², a conservative balance. `pack_pairs` lays a
micro-batch out as [chosen_0, rejected_0, chosen_1, ...] (prompt labels -100, as TRL masks
them) in the format of `DataCollatorWithFlattening(return_position_ids=True)`."""

from __future__ import annotations

from typing import Sequence

import torch

from hf_longctx.data.packing import plan_microbatches
from hf_longctx.data.plan import Plan


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_pairs(
    chosen_lengths: Sequence[int], rejected_lengths: Sequence[int], *, dp_size: int, max_tokens: int,
    doc_multiple: int = 1, seq_multiple: int = 1, **kwargs
) -> Plan:
    """A `Plan` whose piece i is PAIR i: chosen and rejected always in the same micro-batch.

    Args:
        chosen_lengths: Each pair's prompt + chosen length.
        rejected_lengths: Each pair's prompt + rejected length.
        dp_size: As for `plan_microbatches`.
        max_tokens: As for `plan_microbatches` (a pair counts both its documents).
        doc_multiple: Each of a pair's two documents is padded to a multiple of this.
        seq_multiple: As for `plan_microbatches`.
        **kwargs (Any): Passed to `plan_microbatches` (`cost`, `seed`, `strategy`).

    Returns:
        The plan, one piece per pair.

    Raises:
        ValueError: The two lists differ in length, or `overlong` is not "error" (a pair
            is never split or truncated).
    """
    if len(chosen_lengths) != len(rejected_lengths):
        raise ValueError(f"{len(chosen_lengths)} chosen but {len(rejected_lengths)} rejected lengths: give one of each per pair")
    if kwargs.get("overlong", "error") != "error":
        raise ValueError(f"overlong={kwargs['overlong']!r}: a preference pair cannot be split or truncated; "
                         "filter long pairs out or raise max_tokens")
    units = [_padded(int(c), doc_multiple) + _padded(int(r), doc_multiple) for c, r in zip(chosen_lengths, rejected_lengths)]
    return plan_microbatches(units, dp_size=dp_size, max_tokens=max_tokens, doc_multiple=doc_multiple,
                             seq_multiple=seq_multiple, **kwargs)


def pack_pairs(pairs: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]]) -> dict[str, torch.Tensor]:
    """(prompt, chosen, rejected) token lists -> one packed row of 2 documents per pair.

    Args:
        pairs: (prompt, chosen, rejected) token lists, one per pair.

    Returns:
        `input_ids`, `labels` (-100 on the prompts) and `position_ids` (restarting per
            document), each int64 [1, S].

    Raises:
        ValueError: No pair, or a pair with an empty completion.
    """
    if not pairs:
        raise ValueError("pack_pairs needs at least one (prompt, chosen, rejected) pair")
    ids, labels, pos = [], [], []
    for i, (prompt, chosen, rejected) in enumerate(pairs):
        for completion in (chosen, rejected):
            if not completion:
                raise ValueError(f"pair {i} has an empty completion: nothing to score; drop the pair")
            doc = list(prompt) + list(completion)
            ids += doc
            labels += [-100] * len(prompt) + list(completion)
            pos += list(range(len(doc)))
    row = lambda xs: torch.tensor(xs, dtype=torch.long)[None]  # noqa: E731  [1, S]
    return {"input_ids": row(ids), "labels": row(labels), "position_ids": row(pos)}
