"""A patched causal LM's per-token log-probabilities of its targets, through a row-chunked LM head.

Where it sits: the one place post-training objectives (DPO, GRPO, RLOO; policy and frozen
reference) get per-token log-probabilities and entropies of a shard: `token_logprobs(model,
shard)` runs `model(**inputs)` with the LM head's forward replaced, for that call only, by
`ops/chunked_logprobs.chunked_token_logprobs` on the final hidden states (the SFT loss's
device, `memory.py`: the head's weight is unsharded only inside its call under FSDP2).
Guarantees: no `[S_local, V]` tensor beyond one chunk under any memory preset; the head's
output is a `[B, S, 0]` tensor the log-probabilities are joined to, so FSDP2's pre-backward
hook on it gathers the head's weight again before the chunks' backward recomputes logits;
temperature, the softcap and the model's scaling of its logits after the head honoured
(`integrations/logit_maps.py`); a scaling in a form not read there, or a `final_logits_bias`,
is refused before any collective (`check_logprob_head`)."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from hf_longctx.errors import NotSupported
from hf_longctx.integrations.logit_maps import LogitMapError, check_plain_head, logit_maps, logit_softcap
from hf_longctx.integrations.undo import set_instance_attr
from hf_longctx.model_walk import hf_model
from hf_longctx.ops.chunked_logprobs import chunked_token_logprobs
from hf_longctx.ops.loss_rows import config_sizes, loss_chunk_rows

_NOT_MODEL_INPUTS = ("labels", "shift_labels", "num_items_in_batch")


def check_logprob_head(model: Any) -> float | None:
    """The model's logit softcap (None: off), after checking that its LM head is a linear layer
    and that what the model does to the logits after it is read (`logit_maps`). Raises
    `NotSupported` naming the field otherwise (same config on every rank: all raise alike)."""
    hf = hf_model(model)
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if not isinstance(head, nn.Module) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise NotSupported(f"per-token log-probabilities need a linear LM head; {type(hf).__name__}."
                           f"get_output_embeddings() is {type(head).__name__}", "use a causal LM with a linear LM head")
    try:
        check_plain_head(hf)
        logit_maps(hf)
    except LogitMapError as e:
        raise NotSupported(e.what, "use a model without this logit transform") from None
    if isinstance(getattr(hf, "final_logits_bias", None), torch.Tensor):
        raise NotSupported(f"{type(hf).__name__} adds a final_logits_bias buffer to its logits after the LM head; "
                           "the chunked log-probabilities do not", "use a model without it")
    return logit_softcap(hf)


def logprob_chunk_rows(model: Any, rows: int) -> int:
    """Rows per chunk for `rows` tokens: the SFT loss's rule (`ops/loss_rows.loss_chunk_rows`)
    with the patch's `loss_chunk_rows` or `loss_chunks` count, else "auto" (the head is always
    chunked)."""
    from hf_longctx.integrations.model_patch import patch_state

    options = getattr(patch_state(model), "options", None)
    chunks = getattr(options, "loss_chunks", None)
    chunks = chunks if isinstance(chunks, int) and not isinstance(chunks, bool) else "auto"
    return loss_chunk_rows(*config_sizes(hf_model(model).config), rows, chunks, getattr(options, "loss_chunk_rows", None))


def token_logprobs(model: nn.Module, shard: Mapping[str, Any], *, temperature: float = 1.0,
                   stats: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 log-probabilities [B, S_local] of `shard["shift_labels"]`, fp32 statistics [B, S_local, k])
    of `model` on its shard (`shard_batch`'s output; labels and counts are not passed to the model).

    `stats`: names from `ops/chunked_logprobs.STATS` ("entropy", "mean_logit", "is_top1"),
    without gradient. The log-probabilities carry gradients when grad mode is on. A forward of
    `model`: under SP, every rank of the group calls it once per micro-batch."""
    hf = hf_model(model)
    softcap, maps = check_logprob_head(hf), logit_maps(hf)
    head = hf.get_output_embeddings()
    targets = shard["shift_labels"]  # [B, S_local] pre-shifted, -100 where nothing is scored
    inputs = {k: v for k, v in shard.items() if k not in _NOT_MODEL_INPUTS}
    found: list[tuple[torch.Tensor, torch.Tensor]] = []

    def head_logprobs(hidden: torch.Tensor) -> torch.Tensor:
        # Inside the head's call: under FSDP2 its weight is unsharded now (and again in backward, below).
        rows = hidden.shape[0] * hidden.shape[1]
        found.append(chunked_token_logprobs(
            hidden, head.weight, getattr(head, "bias", None), targets=targets.to(hidden.device),
            chunk_size=logprob_chunk_rows(hf, rows), temperature=temperature, final_logit_softcapping=softcap,
            stats=tuple(stats), logit_maps=maps))
        # [B, S, 0], joined to the log-probabilities: what the model does to its logits is free on it, and
        # FSDP2's pre-backward hook on the head's output fires before the chunks' backward (a clone: no view).
        return found[-1][0][..., None][..., :0].clone()

    restore: list = []
    set_instance_attr(head, "forward", head_logprobs, restore)
    try:
        out = model(**inputs)
    finally:
        restore[0]()
    if len(found) != 1:
        raise RuntimeError(f"expected one LM head call in {type(hf).__name__}.forward, saw {len(found)}")
    logps, extra = found[0]
    empty = out["logits"] if isinstance(out, Mapping) else out[0]  # [B, S, 0] after the model's own logit ops
    if logps.requires_grad:
        logps = logps + empty.sum(-1)  # + 0: the gradient reaches the head's output (its FSDP2 hook)
    return logps, extra
