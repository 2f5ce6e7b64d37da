"""Gated DeltaNet under sequence parallelism by state passing: every rank keeps every head.

Where it sits: called by the GDN wrappers of `integrations/mixers/` in place of the head
all-to-all of `gdn.py`, between the module's projections and its gated norm (all on the shard).
The delta rule is affine in the state (Gated Delta Networks §2): over a run,
S_end = M·S_in + S⁰_end and o_t = o⁰_t + S_inᵀ·(M_tᵀ q_t). ONE core call per run over the
value columns [v | 0] from [0 | I] returns o⁰, q̃_t = M_tᵀ q_t, S⁰ and M (the runs as the rows of
one padded batch for transformers' torch path, `ragged.py`); after the scan
(`state_passing.py`) o_t = o⁰_t + q̃_tᵀ S_in corrects each run exactly. The convolution
takes a halo (`conv.halo_conv`). The core is transformers' `torch_chunk_gated_delta_rule`,
or FLA's `chunk_gated_delta_rule` (one varlen call) when installed."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from hf_longctx.ops.mixers.conv import halo_conv
from hf_longctx.ops.mixers.layout import SequenceLayout
from hf_longctx.ops.mixers.ragged import padded_spans
from hf_longctx.ops.mixers.state_passing import MATRIX, ChainPlan, exact_precision, incoming_states, run_bounds


def _augmented_state(b: int, heads: int, dk: int, dv: int, identity: bool, like: torch.Tensor, acc) -> torch.Tensor:
    """[B, H_v, D_k, D_v + D_k] in `acc`: [0 | I] (a run that receives a state) or [0 | 0]."""
    h0 = torch.zeros(b, heads, dk, dv + dk, dtype=acc, device=like.device)
    if identity:
        h0[..., dv:] = torch.eye(dk, dtype=acc, device=like.device)
    return h0


def _cores_padded(core, q, k, v, g, beta, bounds, starts, lay, rank, acc):
    """ONE core call over every local run, the runs as the rows of one zero-padded batch
    (transformers' torch path, which takes no `cu_seqlens`; g = beta = 0 pads leave a run's
    final state as it is). Returns (o⁰, q̃, M, S⁰) per run in the accumulation dtype `acc` (fp32,
    or fp64 for fp64 inputs): o⁰ [B, L, H_v, D_v], q̃ [B, L, H_v, D_k] or None (a run that
    starts a document), M [B, H_v, D_k, D_k], S⁰ [B, H_v, D_k, D_v]."""
    b, s, hv, dv = v.shape
    dk = q.shape[-1]
    pads = padded_spans(lay, ("runs", rank), bounds, s, v.device)
    v_aug = torch.cat([v, v.new_zeros(b, s, hv, dk)], dim=-1)  # [B, S_local, H_v, D_v + D_k]
    h0 = torch.stack([_augmented_state(b, hv, dk, dv, not st, v, acc) for st in starts])  # [n_runs, B, H_v, D_k, D_v + D_k]
    ins = (pads.pad(t.to(acc)) for t in (q, k, v_aug))  # outputs then round once, at the end
    res = [core(qc, kc, vc, g=gc, beta=bc, initial_state=hc, output_final_state=True, use_qk_l2norm_in_kernel=True)
           for qc, kc, vc, gc, bc, hc in zip(*ins, pads.pad(g), pads.pad(beta), pads.rows_of(h0, b))]
    o = pads.unpad([r[0] for r in res], b).to(acc)  # [B, S_local, H_v, D_v + D_k]
    fins = pads.per_span([r[1].to(acc) for r in res], b)  # per run [B, H_v, D_k, D_v + D_k]
    return [(o[:, lo:hi, :, :dv], None if st else o[:, lo:hi, :, dv:], fin[..., dv:], fin[..., :dv])
            for (lo, hi), st, fin in zip(bounds, starts, fins)]


def _cores_varlen(core, q, k, v, g, beta, bounds, starts, lay, rank, acc):
    """One varlen call over all local runs of all rows (flash-linear-attention's
    `chunk_gated_delta_rule(..., cu_seqlens=, initial_state=[N, H_v, D_k, V], output_final_state=True)`,
    B must be 1 there: rows are laid end to end). Same return as `_cores_per_run`."""
    b, s, hv, dv = v.shape
    dk = q.shape[-1]
    n = len(bounds)
    cu = [0]
    for _ in range(b):
        for lo, hi in bounds:
            cu.append(cu[-1] + hi - lo)
    cu_host = torch.tensor(cu, dtype=torch.long)  # [B·n + 1]
    cu_dev = lay.on_device(("gdn_cu_seqlens", b, rank), v.device, lambda: cu_host)
    h0 = torch.stack([_augmented_state(b, hv, dk, dv, not st, v, acc) for st in starts], dim=1)  # [B, n, H_v, D_k, D_v + D_k]
    flat = lambda t: t.reshape(1, b * s, *t.shape[2:])  # noqa: E731  [1, B·S_local, ...]
    v_aug = torch.cat([v, v.new_zeros(b, s, hv, dk)], dim=-1)  # [B, S_local, H_v, D_v + D_k]
    o, fin = core(flat(q), flat(k), flat(v_aug), g=flat(g), beta=flat(beta), initial_state=h0.reshape(b * n, hv, dk, -1),
                  output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_dev,
                  cu_seqlens_cpu=cu_host)
    o = o.reshape(b, s, hv, dv + dk).to(acc)
    fin = fin.to(acc).reshape(b, n, hv, dk, dv + dk)
    return [(o[:, lo:hi, :, :dv], None if st else o[:, lo:hi, :, dv:], fin[:, i, ..., dv:], fin[:, i, ..., :dv])
            for i, ((lo, hi), st) in enumerate(zip(bounds, starts))]


def gdn_state_passing(
    mixed_qkv: torch.Tensor,
    beta: torch.Tensor,
    a: torch.Tensor,
    *,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    activation: Callable[[torch.Tensor], torch.Tensor],
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    core: Callable,
    varlen: bool,
    lay: SequenceLayout,
    rank: int,
    group,
) -> torch.Tensor:
    """The sequence-mixing core of a Gated DeltaNet layer on this rank's shard, all heads.

    mixed_qkv [B, S_local, 2·H_k·D_k + H_v·D_v] BEFORE the convolution; beta, a [B, S_local, H_v]
    (beta already sigmoid-ed, a the raw projection). `core`: the module file's
    `torch_chunk_gated_delta_rule`; `varlen`: it is flash-linear-attention's kernel (one call
    with `cu_seqlens`). Returns core_out [B, S_local, H_v, D_v] in mixed_qkv's dtype.
    Collective over `group` (halo, then the state scan): every SP rank calls it."""
    b, s_local, _ = mixed_qkv.shape
    hv = beta.shape[-1]
    dk, dv = head_k_dim, head_v_dim
    conv = activation(halo_conv(mixed_qkv, lay, conv_weight, conv_bias, rank, group)).to(mixed_qkv.dtype)  # [B, S_local, C]
    q, k, v = conv.split([k_heads * dk, k_heads * dk, hv * dv], dim=-1)
    q = q.reshape(b, s_local, k_heads, dk)  # [B, S_local, H_k, D_k]
    k = k.reshape(b, s_local, k_heads, dk)
    v = v.reshape(b, s_local, hv, dv)  # [B, S_local, H_v, D_v]
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)  # [B, S_local, H_v] fp32, as the module computes it
    acc = torch.promote_types(mixed_qkv.dtype, torch.float32)  # states and corrections: fp32 (fp64 for fp64 inputs)
    plan = ChainPlan.of(lay)
    bounds, starts = run_bounds(lay, rank), plan.starts[rank]
    if varlen:
        runs = _cores_varlen(core, q, k, v, g, beta, bounds, starts, lay, rank, acc)
    else:
        # [H_v]: value head j reads key head j // (H_v/H_k)
        kmap = lay.on_device(("gdn_kmap", hv, k_heads), q.device, lambda: torch.arange(hv) // (hv // k_heads))
        qx, kx = q.index_select(2, kmap), k.index_select(2, kmap)  # [B, S_local, H_v, D_k]
        runs = _cores_padded(core, qx, kx, v, g, beta, bounds, starts, lay, rank, acc)
    zero_a, zero_b = conv.new_zeros(b, hv, dk, dk, dtype=acc), conv.new_zeros(b, hv, dk, dv, dtype=acc)
    maps_a = torch.stack([zero_a if m is None else m for _, _, m, _ in runs])  # [n_runs, B, H_v, D_k, D_k]
    maps_b = torch.stack([zero_b if f is None else f for _, _, _, f in runs])  # [n_runs, B, H_v, D_k, D_v]
    x_in = incoming_states(maps_a, maps_b, lay, MATRIX, rank, group, conv.reshape(-1)[:1].sum())  # [n_runs, B, H_v, D_k, D_v]
    outs = []
    with exact_precision(conv.device):
        for i, (o0, q_tilde, _, _) in enumerate(runs):
            if q_tilde is not None:  # o_t += S_inᵀ q̃_t
                o0 = o0 + torch.einsum("blhk,bhkv->blhv", q_tilde, x_in[i])
            outs.append(o0)
    out = torch.cat(outs, dim=1) + x_in.sum() * 0  # [B, S_local, H_v, D_v]; the zero term keeps the scan in every graph
    return out.to(mixed_qkv.dtype)
