"""Short causal depthwise convolutions of packed documents under sequence parallelism.

Where it sits: the token mixer of LFM2 / LFM2-MoE / LFM3 `ShortConv` (through
`integrations/mixers/`), and the convolution in front of the Gated DeltaNet and Mamba-2
cores. Guarantee: token t reads inputs t-K+1 .. t of the SAME document only, zeros before
a document start, as `F.conv1d(x, padding=K-1)[..., :L]` on that document alone.
`halo_conv` fetches the K-1 previous rows by global index (`SequenceLayout.halo`, one
all-to-all; a chunk shorter than K-1 may need several ranks), lays every local run after
its previous rows and runs ONE unpadded depthwise `F.conv1d` (the op of transformers'
`causal_conv1d_fn`). Pure tensor code; never imports transformers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_longctx.ops.mixers.exchange import halo_rows, scatter_channels
from hf_longctx.ops.mixers.layout import SequenceLayout


def segment_conv(
    x_ext: torch.Tensor, seg_rows: torch.Tensor, out_index: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x_ext [B, N, C]; seg_rows int64 [N'] rows of x_ext forming segments that each start with
    the K-1 rows before their first token; out_index int64 [S_out] outputs to keep (both on
    x_ext's device); weight [C, K] (depthwise `Conv1d.weight.squeeze(1)`); bias [C] or None
    → [B, S_out, C].

    Computed in the weight's dtype, as transformers' `causal_conv1d_fn` does."""
    c = weight.shape[0]
    xp = x_ext.index_select(1, seg_rows).transpose(1, 2).to(weight.dtype)  # [B, C, N']
    y = F.conv1d(xp, weight.unsqueeze(1), bias, groups=c)  # [B, C, N' - K + 1]: no padding, segments carry their own
    return y.index_select(2, out_index).transpose(1, 2)  # [B, S_out, C]


def doc_causal_conv(x: torch.Tensor, lay: SequenceLayout, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [B, S, C]: the WHOLE packed sequence in global order → per-document causal conv [B, S, C]."""
    k = weight.shape[1]
    seg_rows, out_index = lay.on_device(("doc_segments", k), x.device, lambda: lay.doc_segments(k))
    x_ext = torch.cat([x, x.new_zeros(x.shape[0], 1, x.shape[2])], dim=1)  # [B, S + 1, C]: row S is zero
    return segment_conv(x_ext, seg_rows, out_index, weight, bias)


def halo_conv(
    x: torch.Tensor,
    lay: SequenceLayout,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rank: int,
    group,
) -> torch.Tensor:
    """x [B, S_local, C] (this rank's shard, local order) → [B, S_local, C]: the per-document
    causal depthwise convolution, equal to running it on each whole document. Collective
    over `group` (the SP group): every rank must call it."""
    k = weight.shape[1]
    plan = lay.halo(k)
    seg_rows, out_index = lay.on_device(("halo_segments", k, rank), x.device, lambda: (plan.seg_rows[rank], plan.out_index[rank]))
    x_ext = halo_rows(x, lay, k, rank, group)  # [B, S_local + N_halo + 1, C]
    return segment_conv(x_ext, seg_rows, out_index, weight, bias)  # [B, S_local, C]


def scatter_then_conv(
    x: torch.Tensor, chans: list[torch.Tensor], conv_dim: int, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
    activation, lay: SequenceLayout, rank: int, group,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head-parallel mixers' (Gated DeltaNet, Mamba-2) first half: this rank's channels of
    the whole sequence (`scatter_channels`), the first `conv_dim` of them through the
    document-causal depthwise convolution with this rank's rows of the weight, then
    `activation`. x [B, S_local, C]; chans[q]: channels rank q receives, on x's device.
    Returns (convolved [B, S, conv_dim] in x's dtype, the remaining channels
    [B, S, C_rank - conv_dim]), both in global token order."""
    full = scatter_channels(x, chans, lay, rank, group)  # [B, S, C_rank] global order
    conv_in, rest = full.split([conv_dim, full.shape[-1] - conv_dim], dim=-1)
    idx = chans[rank][:conv_dim]  # the weight rows of this rank's channels (a device view)
    w = conv_weight.index_select(0, idx)  # [conv_dim, K]: this rank's channels
    bias = None if conv_bias is None else conv_bias.index_select(0, idx)
    return activation(doc_causal_conv(conv_in, lay, w, bias)).to(x.dtype), rest
