"""Each rank's own rows decoded by its whole SP group: the rollouts of trainers whose sampler gives
every process rows of its own (TRL's).

Where it sits: the generation hook of `LongGRPOTrainer` / `LongRLOOTrainer`
(`training/grpo/rollout_trainer.py`). The SP group's ranks all-gather their prompt lists (ragged:
one `all_gather_object`, every rank joins), `sp_generate` decodes the union in SP-rank order with
each row owned by the rank it came from -- so each rank samples its own rows with its own global
RNG, exactly as `generate` on its batch would -- and each rank takes its own rows' completions
back. The group's cache holds the union's tokens, 1/SP of them per rank: the same per-rank share
as each rank decoding its own rows, but balanced token by token, and a row longer than one
device's cache is decoded by the group."""

from __future__ import annotations

from typing import Any, Sequence

import torch.distributed as dist

from hf_longctx.generation.loop import sp_generate
from hf_longctx.generation.settings import SamplingSettings


def own_rows_rollout(model, prompts: Sequence[Sequence[int]], mesh, settings: SamplingSettings, **options: Any
                     ) -> list[list[int]]:
    """This rank's `prompts` (its own rows; other ranks of the SP group pass theirs) -> their
    completions, decoded by the SP group together. `options`: `sp_generate`'s keywords."""
    mine = [list(map(int, p)) for p in prompts]
    if mesh.sp > 1:
        table: list[Any] = [None] * mesh.sp
        dist.all_gather_object(table, mine, group=mesh.sp_group)  # [SP] x ragged prompt lists, in SP-rank order
    else:
        table = [mine]
    rows = [p for part in table for p in part]
    owners = [r for r, part in enumerate(table) for _ in part]
    if not rows:
        return []
    completions = sp_generate(model, rows, mesh, settings, owners=owners, **options)
    start = sum(len(part) for part in table[: mesh.sp_rank])
    return completions[start : start + len(mine)]
