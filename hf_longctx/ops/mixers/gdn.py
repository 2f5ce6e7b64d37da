"""Gated DeltaNet under sequence parallelism: head-parallel all-to-all over the SP group.

Where it sits: called by the GDN wrappers of `integrations/mixers/` (Qwen3-Next, Qwen3.5 /
Qwen3.5-MoE, OLMo-hybrid) between the module's own input projections and its gated norm +
output projection, which stay on the sequence shard.
"Ulysses for mixers" (DeepSpeed-Ulysses §3 applied to a recurrence): one all-to-all over
the WHOLE SP group gives every rank the whole packed sequence for a subset of heads (key
heads split when P ≤ H_k; else value heads, q/k replicated; refused when H_v < P). The
convolution and the core then run per document from zero state with the GLOBAL boundaries;
the inverse all-to-all brings the output back. beta and g are computed as the module does.
The core runs ONCE per layer: one varlen call (flash-linear-attention's `cu_seqlens`), or the
documents as the rows of one padded batch for transformers' torch fallback (`ragged.py`).
Why the convolution runs after the exchange: docs/DESIGN.md "Decisions and why"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from hf_longctx.ops.mixers.conv import scatter_then_conv
from hf_longctx.ops.mixers.exchange import gather_channels, head_ranges
from hf_longctx.ops.mixers.layout import SequenceLayout
from hf_longctx.ops.mixers.ragged import padded_spans


@dataclass(frozen=True)
class GDNHeads:
    """Which heads every SP rank runs: value heads [v_lo, v_hi) and key heads [k_lo, k_hi)."""

    k_heads: int
    v_heads: int
    ranks: tuple  # ((v_lo, v_hi, k_lo, k_hi), ...) per SP rank

    @staticmethod
    def split(k_heads: int, v_heads: int, sp: int) -> "GDNHeads":
        if k_heads < 1 or v_heads % k_heads:
            raise ValueError(f"Gated DeltaNet needs value heads ({v_heads}) to be a multiple of key heads ({k_heads})")
        r = v_heads // k_heads
        ranks = []
        if sp <= k_heads:
            for p in range(sp):
                k_lo, k_hi = p * k_heads // sp, (p + 1) * k_heads // sp
                ranks.append((k_lo * r, k_hi * r, k_lo, k_hi))
        elif sp <= v_heads:
            ranks = list(head_ranges(v_heads, r, sp))
        else:
            raise ValueError(
                f"Gated DeltaNet with {v_heads} value heads ({k_heads} key heads) cannot be split over an SP group of "
                f"{sp} ranks (ring × ulysses): every rank needs at least one value head; use ulysses × ring ≤ {v_heads}"
            )
        return GDNHeads(k_heads, v_heads, tuple(ranks))

    def channels(self, p: int, head_k_dim: int, head_v_dim: int) -> torch.Tensor:
        """int64 channels of [q | k | v | beta | a] (the concatenated projections) rank p receives."""
        v_lo, v_hi, k_lo, k_hi = self.ranks[p]
        key_dim, value_dim = self.k_heads * head_k_dim, self.v_heads * head_v_dim
        q = torch.arange(k_lo * head_k_dim, k_hi * head_k_dim)
        v = torch.arange(v_lo * head_v_dim, v_hi * head_v_dim)
        heads = torch.arange(v_lo, v_hi)
        base = 2 * key_dim + value_dim
        return torch.cat([q, key_dim + q, 2 * key_dim + v, base + heads, base + self.v_heads + heads])


def gdn_sequence_parallel(
    mixed_qkv: torch.Tensor,
    beta: torch.Tensor,
    a: torch.Tensor,
    *,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    activation: Callable[[torch.Tensor], torch.Tensor],
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    head_k_dim: int,
    head_v_dim: int,
    heads: GDNHeads,
    core: Callable,
    lay: SequenceLayout,
    rank: int,
    group,
    varlen: bool = False,
) -> torch.Tensor:
    """The sequence-mixing core of a Gated DeltaNet layer on this rank's shard.

    mixed_qkv [B, S_local, 2·H_k·D_k + H_v·D_v] BEFORE the convolution; beta, a
    [B, S_local, H_v] (beta already sigmoid-ed, a the raw projection). `core` is
    transformers' `torch_chunk_gated_delta_rule`-compatible function of the module's file;
    `varlen`: it is flash-linear-attention's kernel (takes `cu_seqlens`). Returns core_out [B, S_local, H_v, D_v] (before the gated norm)."""
    b, s_local, _ = mixed_qkv.shape
    v_lo, v_hi, k_lo, k_hi = heads.ranks[rank]
    hk, hv = k_hi - k_lo, v_hi - v_lo
    x = torch.cat([mixed_qkv, beta.to(mixed_qkv.dtype), a.to(mixed_qkv.dtype)], dim=-1)  # [B, S_local, C + 2·H_v]
    dev = mixed_qkv.device
    chans = lay.on_device(("gdn", heads, head_k_dim, head_v_dim), dev,
                          lambda: [heads.channels(p, head_k_dim, head_v_dim) for p in range(lay.sp)])
    conv_dim = 2 * hk * head_k_dim + hv * head_v_dim
    # qkv [B, S, conv_dim] convolved; rest [B, S, 2·hv] (beta, a), both in global order
    qkv, rest = scatter_then_conv(x, chans, conv_dim, conv_weight, conv_bias, activation, lay, rank, group)
    beta_r, a_r = rest.split([hv, hv], dim=-1)  # [B, S, hv] each
    q, k, v = qkv.split([hk * head_k_dim, hk * head_k_dim, hv * head_v_dim], dim=-1)
    q = q.reshape(b, -1, hk, head_k_dim)  # [B, S, hk, D_k]
    k = k.reshape(b, -1, hk, head_k_dim)
    v = v.reshape(b, -1, hv, head_v_dim)  # [B, S, hv, D_v]
    # Value head j of this rank reads key head (v_lo + j) // r: expand q/k per value head,
    # as the core's own repeat_interleave would on the whole head set.
    r = heads.v_heads // heads.k_heads
    kmap = lay.on_device(("gdn_kmap", heads, rank), dev, lambda: torch.arange(v_lo, v_hi) // r - k_lo)  # [hv]
    q, k = q.index_select(2, kmap), k.index_select(2, kmap)  # [B, S, hv, D_k]
    g = -A_log[v_lo:v_hi].float().exp() * F.softplus(a_r.float() + dt_bias[v_lo:v_hi])  # [B, S, hv] fp32

    out = _documents_core(core, q, k, v, g, beta_r, lay, varlen).reshape(b, -1, hv * head_v_dim)  # [B, S, hv·D_v]
    counts = [(hi_ - lo_) * head_v_dim for lo_, hi_, _, _ in heads.ranks]
    back = gather_channels(out, counts, lay, rank, group)  # [B, S_local, H_v·D_v]: ranks' value heads in order
    return back.reshape(b, s_local, heads.v_heads, head_v_dim)


def _documents_core(core: Callable, q, k, v, g, beta, lay: SequenceLayout, varlen: bool) -> torch.Tensor:
    """ONE core call over every document of the whole sequence, each from zero state: q/k
    [B, S, hv, D_k], v [B, S, hv, D_v], g/beta [B, S, hv] -> [B, S, hv, D_v]."""
    b, s = v.shape[:2]
    cu = lay.cu_seqlens
    kw = dict(initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
    if varlen:  # rows laid end to end as one packed sequence (the kernel wants B = 1 with cu_seqlens)
        cu_host = torch.tensor(sorted({r * s + c for r in range(b) for c in cu}), dtype=torch.long)  # [B·docs + 1]
        cu_dev = lay.on_device(("gdn_docs_cu", b), v.device, lambda: cu_host)
        flat = lambda t: t.reshape(1, b * s, *t.shape[2:])  # noqa: E731  [1, B·S, ...]
        out, _ = core(flat(q), flat(k), flat(v), g=flat(g), beta=flat(beta), cu_seqlens=cu_dev, cu_seqlens_cpu=cu_host, **kw)
        return out.reshape(b, s, *out.shape[2:])
    pads = padded_spans(lay, "docs", list(zip(cu[:-1], cu[1:])), s, v.device)
    outs = [core(qc, kc, vc, g=gc, beta=bc, **kw)[0] for qc, kc, vc, gc, bc in zip(*(pads.pad(t) for t in (q, k, v, g, beta)))]
    return pads.unpad(outs, b)  # [B, S, hv, D_v]
