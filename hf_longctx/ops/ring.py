"""Zigzag ring attention over packed documents (USP paper, Algorithm 2; Ring Attention).

Where it sits: `ops/usp.py` calls it after the Ulysses all-to-all, every rank holding its
ring rank's stream `[B, H/U, S_ring, D]` (zigzag chunks r and 2R-1-r of every document).
K/V blocks travel around the ring; each partial result folds in with `ops/lse.py`.
Guarantees: blocks planned from global document boundaries, so packed documents never see
each other and every rank computes the same number of causal scores; sinks merge once,
after the last step (`ops/sinks.py`). Backward: recompute from the final out/lse, dq kept
locally, each block's dK/dV accumulator travels with it back to its owner after R hops.
Three layers: `ring_forward` / `ring_backward` → `RingAttention` → `ring_attention`;
`RingReplay`: the Function with the forward's result given (keep-attention)."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from hf_longctx.layout import Run, ring_stream
from hf_longctx.distributed.comm import RingExchanger
from hf_longctx.ops import blocks, kernels
from hf_longctx.ops.sinks import check_sinks, merge_sink, sink_grad
from hf_longctx.ops.math_kernel import acc_dtype  # float32, or float64 so float64 references stay exact


class RingPlan(NamedTuple):
    """The pure part of a rank's ring schedule: its query runs and, per ring step, the key
    runs it holds and the tiles it computes (empty = nothing to do at that step)."""

    q_runs: list[Run]
    steps: list[tuple[list[Run], list[blocks.Block]]]


def ring_plan(cu: Sequence[int], ring: int, ring_rank: int, *, causal: bool, window: int | None) -> RingPlan:
    """Plan every ring step of rank `ring_rank` from the global boundaries alone."""
    q_runs = ring_stream(cu, ring, ring_rank)
    steps = []
    for step in range(ring):
        k_runs = ring_stream(cu, ring, (ring_rank - step) % ring)
        steps.append((k_runs, blocks.Tiles(blocks.plan_blocks(q_runs, k_runs, causal=causal, window=window))))
    return RingPlan(q_runs, steps)


class RingSpec:
    """What one rank needs to run the ring: peers, its ring position and its plan.

    The plan is made once per call and serves forward and backward; callers that run
    many layers on the same boundaries pass the same `plan` (see `usp_attention`), and the
    local attention backend they chose for the micro-batch (`kernels.batch_backend`; None:
    every kernel call picks its own).
    """

    def __init__(self, *, group, ring: int, ring_rank: int, next_rank: int, prev_rank: int, plan: RingPlan,
                 backend=None):
        self.group, self.ring, self.ring_rank = group, ring, ring_rank
        self.next_rank, self.prev_rank = next_rank, prev_rank
        self.plan, self.backend = plan, backend

    def exchanger(self, tag: int) -> RingExchanger:
        return RingExchanger(self.group, self.next_rank, self.prev_rank, tag=tag)


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.stack([k, v]).contiguous()  # [2, B, H_kv, S_ring, D]: one message per hop


def _shares_buffer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """q, k and v are views of one buffer (the Ulysses all-to-all's receive buffer, a fused
    qkv projection): saving q keeps k and v alive already."""
    base = q.untyped_storage().data_ptr()
    return k.untyped_storage().data_ptr() == base and v.untyped_storage().data_ptr() == base


def _busy_steps(spec: RingSpec) -> int:
    """Ring steps at which this rank computes a tile (its partial results to fold)."""
    return sum(1 for _, tiles in spec.plan.steps if tiles)


def ring_forward(q, k, v, spec: RingSpec, *, scale, causal, window, softcap, sinks=None):
    """q [B, H, S_ring, D], k/v [B, H_kv, S_ring, D] → out [B, H, S_ring, D] (float32, or the
    kernel's dtype when one step computes everything and no sink follows), lse [B, H, S_ring],
    and the packed K/V this rank sent (`_pack(k, v)`, None when R = 1).

    Step 0 computes on k/v as given; the packed copy exists only to travel. The first partial
    result starts one float32 (float64 for float64 inputs) accumulator -- the kernel's own
    buffer, or its one widened copy -- and every later step merges into it in place, only the
    rows it computes (`kernels.varlen_forward(into=...)`, `lse.merge_`, reading each block in
    the kernel's dtype); the caller rounds once. `sinks` [H] join once, after the last step.
    """
    q_runs = spec.plan.q_runs
    acc = acc_dtype(q.dtype)
    sole = _busy_steps(spec) == 1 and sinks is None  # no merge follows: the kernel's result is final
    out = lse = None  # the first block's result starts the merge (no all-zero accumulator)
    ex = spec.exchanger(tag=0)
    packed = kv = None
    for step in range(spec.ring):
        if step + 1 < spec.ring:
            if kv is None:
                kv = packed = _pack(k, v)  # [2, B, H_kv, S_ring, D]
            ex.start(kv)  # the next block is in flight while this one is computed
        k_runs, tiles = spec.plan.steps[step]  # K/V of ring rank (ring_rank - step) mod R
        if tiles:
            kw = dict(scale=scale, causal=causal, window=window, softcap=softcap, blocks=tiles, out_dtype=acc, widen=False,
                      backend=spec.backend)
            if out is None:
                out, lse = kernels.varlen_forward(q, k, v, q_runs, k_runs, **kw)
                out = out if sole else out.to(acc)  # the accumulator: the block's own buffer, or its one widened copy
            else:
                kernels.varlen_forward(q, k, v, q_runs, k_runs, into=(out, lse), **kw)  # merged in place
        if step + 1 < spec.ring:
            kv = ex.wait()
            k, v = kv[0], kv[1]
    if out is None:  # no allowed pair on this rank: out 0, lse -inf (the kernels' empty rows)
        b, h, s, d = q.shape
        out = torch.zeros((b, s, h, d), dtype=acc, device=q.device).transpose(1, 2)  # [B, H, S, D], token-major as every backend's
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    if sinks is not None:  # once, on the complete result: per step it would count R times
        out, lse = merge_sink(out, lse, sinks)
    return out, lse, packed


def ring_backward(dout, q, k, v, kv, out, lse, spec: RingSpec, *, scale, causal, window, softcap):
    """Gradients (dq, dk, dv) of `ring_forward` from the final out/lse; `kv`: the forward's
    packed K/V when it was saved (k, v are its halves), else None (packed here for the first
    send). dk/dv travel with their block as one float32 buffer [2, B, H_kv, S_ring, D]; each
    rank adds its pieces into it, and into its own dq sum, in place (`into=`): no widened
    copy of a block's gradient, no zeros to add into. A gradient with one piece only (R = 1)
    stays in the kernel's dtype."""
    q_runs = spec.plan.q_runs
    acc = acc_dtype(q.dtype)
    sole = _busy_steps(spec) == 1  # dq has one piece: the kernel's gradient as it is
    dq = None  # the first block's dq starts the sum
    kv_ex, dkv_ex = spec.exchanger(tag=0), spec.exchanger(tag=1)
    for step in range(spec.ring):
        if step + 1 < spec.ring:
            if kv is None:
                kv = _pack(k, v)  # [2, B, H_kv, S_ring, D]
            kv_ex.start(kv)
        k_runs, tiles = spec.plan.steps[step]
        # dK/dV of block (ring_rank - step) mod R accumulated by the ranks it already visited (zeros on its owner).
        dkv = dkv_ex.wait() if step > 0 else None
        if tiles:
            into = (dq, *((None, None) if dkv is None else (dkv[0], dkv[1])))
            b_dq, b_dk, b_dv = kernels.varlen_backward(
                dout, q, k, v, out, lse, q_runs, k_runs, scale=scale, causal=causal, window=window, softcap=softcap,
                grad_dtype=acc, blocks=tiles, widen=False, into=into, backend=spec.backend,
            )
            if dq is None:
                dq = b_dq if sole else b_dq.to(acc)  # the sum's start: the piece itself, or its one widened copy
            if dkv is None and spec.ring == 1:
                return dq, b_dk, b_dv
            if dkv is None:  # its owner: the block's first gradient starts the travelling float32 sum
                dkv = torch.empty((2, *k.shape), dtype=acc, device=k.device)  # [2, B, H_kv, S_ring, D]
                dkv[0].copy_(b_dk)
                dkv[1].copy_(b_dv)
        if dkv is None:
            dkv = torch.zeros((2, *k.shape), dtype=acc, device=k.device)  # [2, B, H_kv, S_ring, D]
        if spec.ring > 1:
            dkv_ex.start(dkv)  # on to the next rank; after R hops it is back at the owner
        if step + 1 < spec.ring:
            kv = kv_ex.wait()
            k, v = kv[0], kv[1]
    dkv = dkv_ex.wait() if spec.ring > 1 else dkv
    if dq is None:
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    return dq, dkv[0], dkv[1]


class RingAttention(torch.autograd.Function):
    """Ring forward/backward; with `sinks` [H] (None = no sink) also their gradient.

    Saved for the backward: q, out, lse and ONE copy of K/V -- k and v themselves when they
    share q's buffer (the Ulysses receive buffer, kept alive by q anyway), else the packed
    K/V the forward sent (no re-pack in the backward)."""

    @staticmethod
    def forward(ctx, q, k, v, spec, scale, causal, window, softcap, sinks):
        out, lse, packed = ring_forward(q, k, v, spec, scale=scale, causal=causal, window=window, softcap=softcap, sinks=sinks)
        out = out.to(q.dtype)  # the one rounding of the merged result
        if packed is not None and not _shares_buffer(q, k, v):
            ctx.save_for_backward(q, None, None, packed, out, lse, sinks)
        else:
            ctx.save_for_backward(q, k, v, None, out, lse, sinks)
        ctx.spec, ctx.kw = spec, dict(scale=scale, causal=causal, window=window, softcap=softcap)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, kv, out, lse, sinks = ctx.saved_tensors
        if kv is not None:
            k, v = kv[0], kv[1]
        # dout stays as autograd hands it (usp.py's out is a head-major view of a token-major
        # tensor): the varlen backends gather it token-major without a copy; a .contiguous()
        # here would copy it head-major only for the packed backend to copy it back.
        # out/lse are the sink-merged ones: the sink is a key with v = 0, so every tile's
        # FlashAttention-2 backward stays exact given them (see ops/sinks.py).
        dq, dk, dv = ring_backward(dout, q, k, v, kv, out, lse, ctx.spec, **ctx.kw)
        dsink = sink_grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[8] else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, dsink


class RingReplay(RingAttention):
    """`RingAttention` whose forward result is given: `out` / `lse` [B, H, S_ring(, D)] kept from
    a forward on the same q, k, v (`ring_forward`; out in q's dtype). Nothing is computed and no
    K/V travels; the backward is RingAttention's (keep-attention of row-chunked layers)."""

    @staticmethod
    def forward(ctx, q, k, v, spec, scale, causal, window, softcap, sinks, out, lse):  # type: ignore[override]
        ctx.save_for_backward(q, k, v, None, out, lse, sinks)
        ctx.spec, ctx.kw = spec, dict(scale=scale, causal=causal, window=window, softcap=softcap)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        return (*RingAttention.backward(ctx, dout), None, None)


def ring_attention(q, k, v, spec: RingSpec, *, scale: float, causal: bool = True, window=None, softcap=None, sinks=None):
    """Differentiable ring attention. q [B, H, S_ring, D], k/v [B, H_kv, S_ring, D] → [B, H, S_ring, D].

    `sinks`: None, or [H] per-head sink logits (differentiable), merged once into the final
    log-sum-exp (`ops/sinks.py`). With R = 1 and no sinks this is the local varlen kernel
    over the whole stream; with sinks it is the same ring Function with one step (no
    exchange), so the sink merge and its gradient live in one place.
    """
    check_sinks(sinks, q.shape[1])
    if spec.ring == 1 and sinks is None:
        runs, (_, tiles) = spec.plan.q_runs, spec.plan.steps[0]
        return kernels.local_attention(
            q, k, v, runs, runs, scale=scale, causal=causal, window=window, softcap=softcap, blocks=tiles,
            backend=spec.backend,
        )
    return RingAttention.apply(q, k, v, spec, scale, causal, window, softcap, sinks)


def ring_work(cu: Sequence[int], ring: int, ring_rank: int, *, causal: bool = True, window=None) -> list[int]:
    """Score elements rank `ring_rank` computes at each ring step (the load-balance measure)."""
    plan = ring_plan(cu, ring, ring_rank, causal=causal, window=window)
    return [blocks.score_count(tiles, causal=causal, window=window) for _, tiles in plan.steps]
