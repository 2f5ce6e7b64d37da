"""Short causal depthwise convolutions of packed documents under sequence parallelism.

Where it sits: the token mixer of LFM2 / LFM2-MoE / LFM3 `ShortConv` (through
`integrations/mixers.py`), and the convolution in front of the Gated DeltaNet and Mamba-2
cores (`ops/mixers/gdn.py`, run there on the whole sequence after the head exchange).

A causal depthwise convolution of K taps reads, for token t, the inputs t-K+1 .. t of the
SAME document (documents start fresh: the taps before a document start read zeros, as
`F.conv1d(x, padding=K-1)[..., :L]` on that document alone). Under SP a rank holds zigzag
chunks of documents, so the K-1 previous inputs may live on other ranks -- possibly
several, since a chunk may be shorter than K-1. `halo_conv` fetches exactly those rows by
global index (`SequenceLayout.halo`, one all-to-all of at most (K-1) rows per local run),
then every tap is a gather: out[t] = bias + Σ_j w[:, j] · x[tap_j(t)].

Pure tensor code; never imports transformers.
"""

from __future__ import annotations

from typing import Callable

import torch

from hf_longctx.ops.mixers.exchange import halo_rows
from hf_longctx.ops.mixers.layout import SequenceLayout


def tap_conv(x_ext: torch.Tensor, tap_rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x_ext [B, N, C]; tap_rows int64 [S_out, K] rows of x_ext (invalid taps point at a zero
    row); weight [C, K] (depthwise `Conv1d.weight.squeeze(1)`); bias [C] or None → [B, S_out, C].

    Computed in the weight's dtype, as transformers' `causal_conv1d_fn` does."""
    k = weight.shape[1]
    x_ext = x_ext.to(weight.dtype)
    out = None
    for j in range(k):  # K is 2-4: K gathers beat one [B, S, K, C] temporary
        term = x_ext.index_select(1, tap_rows[:, j].to(x_ext.device)) * weight[:, j]  # [B, S_out, C]
        out = term if out is None else out + term
    return out if bias is None else out + bias


def doc_causal_conv(x: torch.Tensor, lay: SequenceLayout, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [B, S, C]: the WHOLE packed sequence in global order → per-document causal conv [B, S, C]."""
    s = x.shape[1]
    pos, valid = lay.taps(torch.arange(s), weight.shape[1])  # [S, K]
    rows = torch.where(valid, pos, torch.full_like(pos, s))  # invalid taps → the appended zero row
    x_ext = torch.cat([x, x.new_zeros(x.shape[0], 1, x.shape[2])], dim=1)  # [B, S + 1, C]
    return tap_conv(x_ext, rows, weight, bias)


def halo_conv(
    x: torch.Tensor,
    lay: SequenceLayout,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rank: int,
    group,
    activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [B, S_local, C] (this rank's shard, local order) → [B, S_local, C]: the per-document
    causal depthwise convolution (then `activation`), equal to running it on each whole
    document. Collective over `group` (the SP group): every rank must call it."""
    plan = lay.halo(weight.shape[1])
    x_ext = halo_rows(x, lay, weight.shape[1], rank, group)  # [B, S_local + N_halo + 1, C]
    out = tap_conv(x_ext, plan.tap_rows[rank], weight, bias)  # [B, S_local, C]
    return out if activation is None else activation(out)
