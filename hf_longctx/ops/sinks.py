"""Attention sinks: a learned per-head logit that joins the softmax denominator once.

Where it sits: next to `ops/lse.py`. Models such as GPT-OSS pass a per-head `s_aux` [H];
HF's eager attention adds it as one extra key with value zero. That is the merge of the
real keys' (o_A, l_A) with a key set of output 0: L = logaddexp(l_A, sink_h),
o = exp(l_A - L) · o_A. Ring attention and FPDT call `merge_sink` ONCE on the final
(out, lse) and save that pair for the backward, whose per-tile formulas then stay exact
(FlashAttention-2, Algorithm 2); `sink_grad` gives
    dsink_h = -Σ_{batch, rows} exp(sink_h - L) · rowsum(dO ∘ O).
Layout: out [B, h, S, D], lse [B, h, S], sinks [h] (the heads this rank computes)."""

from __future__ import annotations

import torch


def check_sinks(sinks: torch.Tensor | None, heads: int) -> None:
    """Raise ValueError unless `sinks` is None or a floating [heads] tensor."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or tuple(sinks.shape) != (heads,):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        dtype = sinks.dtype if isinstance(sinks, torch.Tensor) else None
        raise ValueError(f"sinks must be a floating tensor of shape [H] = [{heads}] (one logit per query head), got {shape} {dtype}")


def _per_row(sinks: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    return sinks.to(lse.dtype).view(1, -1, 1)  # [1, h, 1], broadcast over batch and rows of lse [B, h, S]


def merge_sink(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold the sink logits into the final (out, lse) of every real key: the merge of
    `ops/lse.py` with a key set of output 0 and log-normaliser `sinks`.

    out [B, h, S, D] and lse [B, h, S] in the accumulation dtype (float32/float64), sinks [h].
    A row with no real key (lse -inf) gets out 0 and lse = sink. Written out rather than
    calling `lse.merge` with a zero output block: the sink's output is 0, so only the
    rescale of `out` remains (no [B, h, S, D] zeros, no multiply-add against them).
    """
    if out.shape[:-1] != lse.shape or lse.shape[1] != sinks.shape[0]:
        raise ValueError(f"merge_sink needs out [B, h, S, D], lse [B, h, S], sinks [h]; got {tuple(out.shape)}, {tuple(lse.shape)}, {tuple(sinks.shape)}")
    s = _per_row(sinks, lse)
    new_lse = torch.logaddexp(lse, s)  # [B, h, S]
    # new_lse is -inf only if lse and the sink both are: keep out 0 instead of exp(-inf + inf) = NaN.
    ref = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    return out * torch.exp(lse - ref).unsqueeze(-1).to(out.dtype), new_lse  # [B, h, S, 1] broadcast along D


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """dsink [h] = -Σ_{B, S} exp(sink - L) · rowsum(dO ∘ O), from the FINAL (sink-merged) out
    [B, h, S, D] and lse L [B, h, S]; computed in lse's dtype and returned in the sinks' dtype.

    A caller holding the query rows in pieces (FPDT chunks) calls it per piece and sums."""
    acc = lse.dtype
    p_sink = torch.exp(_per_row(sinks, lse) - lse)  # [B, h, S]; lse >= sink, so p_sink <= 1
    p_sink = p_sink.masked_fill(torch.isneginf(lse), 0.0)  # sink -inf and no key: no weight, not NaN
    d = (dout.to(acc) * out.to(acc)).sum(-1)  # [B, h, S]: rowsum(dO ∘ O)
    return -(p_sink * d).sum((0, 2)).to(sinks.dtype)  # [h]
