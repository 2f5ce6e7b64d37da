"""Mamba-2 (SSD) under sequence parallelism by state passing: every rank keeps every head.

Where it sits: called by the Mamba-2 wrappers of `integrations/mixers/` in place of the
head all-to-all of `mamba2.py` (all on the shard). SSD has a SCALAR decay per head (Mamba-2
§3-§6): over a run, h_t = h⁰_t + exp(ΣΔA up to t)·h_in. The runs are scanned from zero state
by ONE call of the module's own chunked scan (`mamba2_chunk_scan`), the runs as the rows of
one padded batch (`ragged.py`), giving y⁰ and h⁰_end [B, H, P, N] per run; after
`state_passing.py`, y_t = y⁰_t + exp(cumΔA_t)·(C_t·h_in) corrects it exactly (one einsum). Δ = clamp(softplus(dt + dt_bias)) is computed once in fp32 and passed to the scan
as is, so scan and correction use the same Δ. The convolution takes a halo (`conv.halo_conv`)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from hf_longctx.ops.mixers.conv import halo_conv
from hf_longctx.ops.mixers.layout import SequenceLayout
from hf_longctx.ops.mixers.ragged import padded_spans
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
    pads = padded_spans(lay, ("runs", rank), bounds, s_local, xs.device)
    xs_p, delta_p, bm_p, cm_p = (pads.pad(t) for t in (xs, delta, bm, cm))  # per call [B·n, L, ...]; Δ = 0 pads
    res = [scan(x_c, d_c, A, b_c, c_c, chunk_size=chunk_size, D=D, dt_bias=None, dt_softplus=False,
                return_final_states=True, state_dtype=acc) for x_c, d_c, b_c, c_c in zip(xs_p, delta_p, bm_p, cm_p)]
    y0 = pads.unpad([y for y, _ in res], b).to(acc)  # [B, S_local, H, P_h]
    finals = pads.per_span([f.to(acc) for _, f in res], b)  # per run [B, H, P_h, N]
    cum_p = [torch.cumsum(d_c * A, dim=1) for d_c in delta_p]  # [B·n, L, H]: log decay from the run start to t
    ends = lay.on_device(("mamba2_run_ends", rank), xs.device, lambda: torch.tensor([hi - 1 for _, hi in bounds]))
    maps_a = pads.unpad(cum_p, b).index_select(1, ends).exp().transpose(0, 1)[..., None, None]  # [n_runs, B, H, 1, 1]
    zero = conv.new_zeros(b, heads, head_dim, state, dtype=acc)
    maps_b = torch.stack([f if cont else zero for f, cont in zip(finals, continues)])  # [n_runs, B, H, P_h, N]
    h_in = incoming_states(maps_a, maps_b, lay, SCALAR, rank, group, conv.reshape(-1)[:1].sum())  # [n_runs, B, H, P_h, N]
    receives = lay.on_device(("mamba2_receives", rank), xs.device,
                             lambda: torch.tensor([0.0 if st else 1.0 for st in starts]))  # [n_runs]: 0 at a document start
    h_in_r = pads.rows_of(h_in * receives[:, None, None, None, None], b)  # per call [B·n, H, P_h, N]
    with exact_precision(conv.device):  # y_t += exp(cumΔA_t) · C_t·h_in of its run
        corr = [torch.einsum("blhn,bhpn->blhp", c_c.to(acc).index_select(2, gmap), h_c) * cum_c.exp()[..., None]
                for c_c, h_c, cum_c in zip(cm_p, h_in_r, cum_p)]  # [B·n, L, H, P_h]
        y = y0 + pads.unpad(corr, b)
    y = y + h_in.sum() * 0  # [B, S_local, H, P_h]; the zero term keeps the scan in every graph
    return y.reshape(b, s_local, heads * head_dim)
