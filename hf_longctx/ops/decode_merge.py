"""The SP group's merge of decode partials: every rank's (out, lse) over its own keys -> the
attention over all keys, identical on every rank.

Where it sits: after `ops/decode_attention.decode_partial` in each attention layer of a decode
step (`integrations/generation_binding.py`). The ranks' key sets are disjoint (each holds the
K/V of its own tokens), so the exact result is the log-sum-exp merge of their partials -- the
same merge as the ring's steps (`ops/lse.merge_`), here across the group in one all-gather, as
decode context parallelism merges split-KV partials across GPUs (flash-decoding's reduction
step). Guarantees: every rank folds the same gathered partials in the same (SP-rank) order, so
the result is bitwise identical on every rank of the group -- the token-wise layers after it then
compute the same logits everywhere; attention sinks join once, after the merge (`ops/sinks.py`);
fp32 throughout, rounded once by the caller. One collective per layer and step:
SP x N x H x (D + 1) fp32 values received per rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_longctx.ops.lse import merge_
from hf_longctx.ops.sinks import check_sinks, merge_sink


def fold_partials(parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The SP ranks' packed partials ([N, H, D + 1] float32 each: out, then lse as the last column, in
    SP-rank order) folded into (out [N, H, D], lse [N, H]) with `ops/lse.merge_`, first to last, IN
    PLACE into parts[0]: the results are views of parts[0] (strided: a row of D + 1), which the
    caller gives up (its columns are overwritten); the other parts are only read."""
    d = parts[0].shape[-1] - 1
    out, lse = parts[0][..., :d], parts[0][..., d]  # [N, H, D], [N, H]: the fp32 accumulators, views of parts[0]
    for part in parts[1:]:
        merge_(out, lse, part[..., :d], part[..., d])
    return out, lse


def merge_partials(
    out: torch.Tensor, lse: torch.Tensor, *, group=None, size: int = 1, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [N, H, D] and lse [N, H] (float32, this rank's partial) -> the merged out [N, H, D] float32,
    the same on every rank of `group` (`size` ranks; 1: no collective). `sinks`: None or the per-head
    sink logits [H], folded into the merged result once. The result may be strided (a view of the
    gathered buffer, or of the sink merge's transpose): the caller rounds it into a contiguous copy."""
    if out.shape[:-1] != lse.shape or out.dtype != torch.float32 or lse.dtype != torch.float32:
        raise ValueError(f"merge_partials needs out [N, H, D] and lse [N, H] in float32, got {tuple(out.shape)} "
                         f"{out.dtype} and {tuple(lse.shape)} {lse.dtype}")
    check_sinks(sinks, out.shape[1])
    if size > 1:
        packed = torch.cat([out, lse.unsqueeze(-1)], dim=-1)  # [N, H, D + 1]: one message per rank
        parts = [torch.empty_like(packed) for _ in range(size)]
        dist.all_gather(parts, packed, group=group)  # [SP] x [N, H, D + 1], in SP-rank order
        out, lse = fold_partials(parts)  # in SP-rank order on every rank: identical results; parts are ours
    if sinks is not None:
        o, _ = merge_sink(out.transpose(0, 1).unsqueeze(0), lse.t().unsqueeze(0), sinks)  # [1, H, N, D], [1, H, N]
        out = o[0].transpose(0, 1)  # [N, H, D]
    return out
