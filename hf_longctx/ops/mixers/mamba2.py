"""Mamba-2 (SSD) under sequence parallelism: head-parallel all-to-all with group replication.

Where it sits: called by the Mamba-2 wrappers of `integrations/mixers/` (Bamba, Granite-4
hybrid, Falcon-H1, Nemotron-H, Zamba2) between the module's input projection and its gated
RMSNorm + output projection, which stay on the shard (the fused conv+scan+norm+out path
is bypassed). Mamba-2 §7 head parallelism, applied along the sequence: one all-to-all over
the WHOLE SP group gives every rank the whole sequence for a contiguous (possibly uneven)
range of heads plus the B/C of their groups (replicated when n_groups < P; autograd sums
the replicas' gradients). Convolution and scan run per document from zero state, the scan in
ONE call per layer (mamba_ssm's `seq_idx`, or the documents as the rows of one padded batch
for transformers' torch fallback, `ragged.py`); the fp32 output returns by the inverse
all-to-all before the gated RMSNorm."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from hf_longctx.ops.mixers.conv import scatter_then_conv
from hf_longctx.ops.mixers.exchange import gather_channels, head_ranges
from hf_longctx.ops.mixers.layout import SequenceLayout
from hf_longctx.ops.mixers.ragged import padded_spans


@dataclass(frozen=True)
class Mamba2Heads:
    """Heads [h_lo, h_hi) and groups [g_lo, g_hi) every SP rank runs."""

    heads: int
    groups: int
    ranks: tuple  # ((h_lo, h_hi, g_lo, g_hi), ...) per SP rank

    @staticmethod
    def split(heads: int, groups: int, sp: int) -> "Mamba2Heads":
        if groups < 1 or heads % groups:
            raise ValueError(f"Mamba-2 needs its heads ({heads}) to be a multiple of n_groups ({groups})")
        if sp > heads:
            raise ValueError(
                f"Mamba-2 with {heads} heads cannot be split over an SP group of {sp} ranks (ring × ulysses): every rank "
                f"needs at least one head; use ulysses × ring ≤ {heads}"
            )
        return Mamba2Heads(heads, groups, head_ranges(heads, heads // groups, sp))

    def channels(self, p: int, head_dim: int, state: int) -> torch.Tensor:
        """int64 channels of [x | B | C | dt] (the conv input, then dt) rank p receives."""
        h_lo, h_hi, g_lo, g_hi = self.ranks[p]
        inner, gn = self.heads * head_dim, self.groups * state
        x = torch.arange(h_lo * head_dim, h_hi * head_dim)
        bc = torch.arange(g_lo * state, g_hi * state)
        dt = torch.arange(h_lo, h_hi)
        return torch.cat([x, inner + bc, inner + gn + bc, inner + 2 * gn + dt])


def mamba2_sequence_parallel(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    *,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    activation: Callable[[torch.Tensor], torch.Tensor],
    A_log: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple,
    head_dim: int,
    state: int,
    chunk_size: int,
    heads: Mamba2Heads,
    scan: Callable,
    lay: SequenceLayout,
    rank: int,
    group,
    varlen: bool = False,
) -> torch.Tensor:
    """The SSD core of a Mamba-2 layer on this rank's shard.

    xbc [B, S_local, H·P_h + 2·G·N] BEFORE the convolution; dt [B, S_local, H] raw (before
    dt_bias / softplus). `scan` is transformers' `mamba2_chunk_scan`-compatible function of
    the module's file; `varlen`: it is mamba_ssm's `mamba_chunk_scan_combined` (takes
    `seq_idx`). Returns y [B, S_local, H·P_h] (the scan's dtype, fp32) before the norm."""
    b, s_local, _ = xbc.shape
    h_lo, h_hi, g_lo, g_hi = heads.ranks[rank]
    hp, gp = h_hi - h_lo, g_hi - g_lo
    x = torch.cat([xbc, dt.to(xbc.dtype)], dim=-1)  # [B, S_local, conv_dim + H]
    dev = xbc.device
    chans = lay.on_device(("mamba2", heads, head_dim, state), dev,
                          lambda: [heads.channels(p, head_dim, state) for p in range(lay.sp)])
    conv_dim = hp * head_dim + 2 * gp * state
    # xbc_r [B, S, conv_dim] convolved; dt_r [B, S, hp], both in global order
    xbc_r, dt_r = scatter_then_conv(x, chans, conv_dim, conv_weight, conv_bias, activation, lay, rank, group)
    xs, B, C = xbc_r.split([hp * head_dim, gp * state, gp * state], dim=-1)
    xs = xs.reshape(b, -1, hp, head_dim)  # [B, S, hp, P_h]
    # Head h of this rank reads group h // (H/G): give the scan one B/C per head (its own
    # repeat_interleave then is the identity), since a rank's heads need not split its groups evenly.
    gmap = lay.on_device(
        ("mamba2_gmap", heads, rank), dev, lambda: torch.arange(h_lo, h_hi) // (heads.heads // heads.groups) - g_lo
    )  # [hp]
    B = B.reshape(b, -1, gp, state).index_select(2, gmap)  # [B, S, hp, N]
    C = C.reshape(b, -1, gp, state).index_select(2, gmap)
    A = -torch.exp(A_log[h_lo:h_hi].float())  # [hp]

    kw = dict(chunk_size=chunk_size, D=D[h_lo:h_hi], dt_bias=dt_bias[h_lo:h_hi], dt_softplus=True, dt_limit=dt_limit,
              initial_states=None, return_final_states=False)
    cu = lay.cu_seqlens
    if varlen:  # one call; the kernel restarts the state where seq_idx changes
        seq_idx = lay.on_device(("mamba2_seq_idx", b), dev, lambda: _seq_idx(cu, b))  # [B, S] int32
        y = scan(xs, dt_r, A, B, C, seq_idx=seq_idx, **kw)  # [B, S, hp, P_h]
    else:
        pads = padded_spans(lay, "docs", list(zip(cu[:-1], cu[1:])), xs.shape[1], dev)
        ys = [scan(xc, dc, A, bc, cc, **kw) for xc, dc, bc, cc in zip(*(pads.pad(t) for t in (xs, dt_r, B, C)))]
        y = pads.unpad(ys, b)  # [B, S, hp, P_h]
    y = y.reshape(b, -1, hp * head_dim)  # [B, S, hp·P_h]
    counts = [(hi_ - lo_) * head_dim for lo_, hi_, _, _ in heads.ranks]
    return gather_channels(y, counts, lay, rank, group)  # [B, S_local, H·P_h]


def _seq_idx(cu, b: int) -> torch.Tensor:
    """int32 [B, S]: the document index of every position (mamba_ssm's `seq_idx`)."""
    lengths = torch.tensor([hi - lo for lo, hi in zip(cu[:-1], cu[1:])])
    return torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths).expand(b, -1).contiguous()
