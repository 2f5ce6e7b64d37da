"""Mamba-2 (SSD) under sequence parallelism by state passing: every rank keeps every head.

Where it sits: called by the Mamba-2 wrappers of `integrations/mixers/` in place of the
head all-to-all of `mamba2.py` (all on the shard). SSD has a SCALAR decay per head (Mamba-2
§3-§6): over a run, h_t = h⁰_t + exp(ΣΔA up to t)·h_in. Each run is scanned from zero state
by the module's own chunked scan (`mamba2_chunk_scan`), giving y⁰ and h⁰_end [B, H, P, N];
after `state_passing.py`, y_t = y⁰_t + exp(cumΔA_t)·(C_t·h_in) corrects it exactly (one
einsum). Δ = clamp(softplus(dt + dt_bias)) is computed once in fp32 and passed to the scan
as is, so scan and correction use the same Δ. The convolution takes a halo (`conv.halo_conv`)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from hf_longctx.ops.mixers.conv import halo_conv
from hf_longctx.ops.mixers.layout import SequenceLayout
from hf_longctx.ops.mixers.state_passing import SCALAR, ChainPlan, exact_precision, incoming_states, run_bounds


def mamba2_state_passing(
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
    heads: int,
    groups: int,
    head_dim: int,
    state: int,
    chunk_size: int,
    scan: Callable,
    lay: SequenceLayout,
    rank: int,
    group,
) -> torch.Tensor:
    """The SSD core of a Mamba-2 layer on this rank's shard, all heads.

    xbc [B, S_local, H·P_h + 2·G·N] BEFORE the convolution; dt [B, S_local, H] raw (before
    dt_bias / softplus). `scan`: the module file's `mamba2_chunk_scan`. Returns
    y [B, S_local, H·P_h] before the gated norm, in fp32 (fp64 for fp64 inputs). Collective over `group` (halo, then
    the state scan): every SP rank calls it."""
    b, s_local, _ = xbc.shape
    conv = activation(halo_conv(xbc, lay, conv_weight, conv_bias, rank, group)).to(xbc.dtype)  # [B, S_local, conv_dim]
    xs, bm, cm = conv.split([heads * head_dim, groups * state, groups * state], dim=-1)
    xs = xs.reshape(b, s_local, heads, head_dim)  # [B, S_local, H, P_h]
    bm = bm.reshape(b, s_local, groups, state)  # [B, S_local, G, N]
    cm = cm.reshape(b, s_local, groups, state)
    acc = torch.promote_types(xbc.dtype, torch.float32)  # Δ, states, corrections: fp32 (fp64 for fp64 inputs)
    delta = F.softplus(dt.to(acc) + dt_bias.to(acc)).clamp(min=dt_limit[0], max=dt_limit[1])  # [B, S_local, H]
    A = -torch.exp(A_log.to(acc))  # [H]
    gmap = lay.on_device(("mamba2_gmap", heads, groups), xs.device, lambda: torch.arange(heads) // (heads // groups))  # [H]
    plan = ChainPlan.of(lay)
    bounds, starts, continues = run_bounds(lay, rank), plan.starts[rank], plan.continues[rank]
    runs = []
    for (lo, hi), cont in zip(bounds, continues):
        res = scan(xs[:, lo:hi], delta[:, lo:hi], A, bm[:, lo:hi], cm[:, lo:hi], chunk_size=chunk_size, D=D,
                   dt_bias=None, dt_softplus=False, return_final_states=cont, state_dtype=acc)
        y0, fin = res if cont else (res, None)  # [B, L, H, P_h], [B, H, P_h, N]
        cum = torch.cumsum(delta[:, lo:hi] * A, dim=1)  # [B, L, H]: log of the decay from the run start to t
        runs.append((y0.to(acc), fin, cum))
    zero = conv.new_zeros(b, heads, head_dim, state, dtype=acc)
    maps_a = torch.stack([cum[:, -1].exp()[..., None, None] for _, _, cum in runs])  # [n_runs, B, H, 1, 1]
    maps_b = torch.stack([zero if f is None else f.to(acc) for _, f, _ in runs])  # [n_runs, B, H, P_h, N]
    h_in = incoming_states(maps_a, maps_b, lay, SCALAR, rank, group, conv.reshape(-1)[:1].sum())  # [n_runs, B, H, P_h, N]
    outs = []
    with exact_precision(conv.device):
        for i, ((lo, hi), start, (y0, _, cum)) in enumerate(zip(bounds, starts, runs)):
            if not start:  # y_t += exp(cumΔA_t) · C_t·h_in
                c = cm[:, lo:hi].to(acc).index_select(2, gmap)  # [B, L, H, N]
                y0 = y0 + cum.exp()[..., None] * torch.einsum("blhn,bhpn->blhp", c, h_in[i])
            outs.append(y0)
    y = torch.cat(outs, dim=1) + h_in.sum() * 0  # [B, S_local, H, P_h]; the zero term keeps the scan in every graph
    return y.reshape(b, s_local, heads * head_dim)
