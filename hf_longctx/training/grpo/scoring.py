"""Per-token log-probabilities of TRL's padded rollout batch, computed under sequence parallelism
and handed back in TRL's layout.

Where it sits: behind TRL's `_get_per_token_logps_and_entropies` hook where a trainer's SCORING
needs per-token values before the loss (RLOO: the policy's and the reference's log-probs of
every completion token, whose difference is the KL penalty in the reward, RLOO paper
(Ahmadian et al. 2024) §3 as TRL 1.16 implements it). TRL passes this process's rows padded
to [B, P + C]; `padded_token_logps` all-gathers the SP group's rows, packs them as
prompt+completion documents (`grpo.loss.pack_rows`; micro-batches under `max_tokens` by the
same plan as the training step, `grpo/microbatches.py`), runs the sharded forward
(`grpo.loss.shard_token_logps`, the one log-prob path), puts the per-token values back in the
packed row's order (`distributed/gather.py`) and returns this process's [B, C] completion
log-probs, right-padded with 0 as TRL's completion mask expects. Every rank of the world runs
the same number of forwards (the plan's count is agreed over the world)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hf_longctx.devices import to_device
from hf_longctx.distributed.gather import gather_sequence
from hf_longctx.training.grpo.loss import pack_rows, shard_completions, shard_token_logps
from hf_longctx.training.grpo.microbatches import plan_rows


def batch_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor,
               logits_to_keep: int) -> list[tuple[list[int], list[int]]]:
    """TRL's padded batch -> (prompt ids, completion ids) per row: input_ids / attention_mask
    [B, P + C] are the left-padded prompts then the right-padded completions, C = logits_to_keep."""
    cut = input_ids.shape[1] - logits_to_keep
    ids, mask = input_ids.cpu(), attention_mask.cpu().bool()  # [B, P + C]
    return [(ids[i, :cut][mask[i, :cut]].tolist(), ids[i, cut:][mask[i, cut:]].tolist()) for i in range(ids.shape[0])]


@torch.no_grad()
def padded_token_logps(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       logits_to_keep: int, mesh, *, temperature: float, max_tokens: int | None,
                       pad_token_id: int, device: Any) -> torch.Tensor:
    """fp32 [B, C]: the log-probability under `model` (of logits / temperature) of every completion
    token of this process's padded batch (module docstring), 0 past each completion. A collective
    over the world: every rank calls it once per scoring pass, with its own rows."""
    mine = batch_rows(input_ids, attention_mask, logits_to_keep)
    rows, first = mine, 0
    if mesh.sp > 1:
        table: list[Any] = [None] * mesh.sp
        dist.all_gather_object(table, mine, group=mesh.sp_group)  # [SP] x ragged rows, in SP-rank order
        rows = [r for part in table for r in part]
        first = sum(len(part) for part in table[: mesh.sp_rank])
    per_row: list[torch.Tensor] = [torch.empty(0)] * len(rows)
    for b in plan_rows([len(p) + len(c) for p, c in rows], mesh, max_tokens):  # the same count on every rank
        packed = pack_rows([rows[i][0] for i in b], [rows[i][1] for i in b])
        shard = to_device(shard_completions(packed, mesh, pad_token_id=pad_token_id), device)
        logps, _, _ = shard_token_logps(model, shard, temperature)  # [1, S_local]
        if hasattr(model, "reshard"):  # FSDP2 keeps the root unsharded after forward (for a backward)
            model.reshard()
        full = gather_sequence(logps.float(), shard, mesh)[0]  # [S]: the packed row's order, padding removed
        at = 0
        for i in b:
            p, c = rows[i]
            per_row[i] = full[at + len(p) - 1: at + len(p) - 1 + len(c)]  # position len(p) - 1 + t predicts token t
            at += len(p) + len(c)
    out = torch.zeros(len(mine), logits_to_keep, dtype=torch.float32, device=input_ids.device)  # [B, C]
    for k in range(len(mine)):
        values = per_row[first + k]
        out[k, : values.numel()] = values.to(out.device)
    return out
