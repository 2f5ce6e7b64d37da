"""Unified sequence parallelism: Ulysses × zigzag ring on the 2D SP mesh (USP paper §3-4).

Where it sits: the attention `integrations/model_patch.py` registers calls `usp_attention`
with the rows this rank holds (`SPMesh.local_indices`): Ulysses all-to-all
[B, S_local, H, D] → [B, S_ring, H/U, D]; zigzag ring attention over the ring group; the
inverse all-to-all. U = 1 skips the all-to-alls; R = 1 runs the local kernel (with sinks,
the one-step ring Function, where the sink merge lives).
Guarantee: shapes, heads and boundaries are checked on every rank from shared information
BEFORE the first collective, so bad input raises the same ValueError everywhere.
`usp_forward_kept` / `usp_replay`: the same call split for keep-attention of row-chunked
layers -- a forward that also returns the ring's merged out/lse, and a differentiable rerun
that replaces the ring by them (no attention kernel)."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.ops import kernels
from hf_longctx.ops.backends import AttentionChoice
from hf_longctx.ops.ring import RingReplay, RingSpec, ring_attention, ring_forward, ring_plan
from hf_longctx.ops.sinks import check_sinks
from hf_longctx.ops.ulysses import gather_heads, kv_replication, scatter_heads


def local_sinks(sinks: torch.Tensor, mesh: SPMesh) -> torch.Tensor:
    """[H] → [H/U]: the sinks of the query heads this Ulysses rank holds after the all-to-all,
    a contiguous slice (`comm.seq_to_head` sends head slice u to Ulysses rank u; KV
    replication for H_kv < U never reorders query heads). The slice is differentiable:
    each rank's sink gradient lands in its own heads, and summing gradients over the SP
    group (as every parameter's) gives the whole."""
    per_rank = sinks.shape[0] // mesh.ulysses
    return sinks[mesh.ulysses_rank * per_rank : (mesh.ulysses_rank + 1) * per_rank]  # [H/U]


def check_tensors(q, k, v, mesh: SPMesh, window, softcap, sinks=None) -> None:
    """The per-call checks: shapes, dtypes, heads, window, softcap, sinks."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, S_local, H, D]; got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree in B, S_local and D")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    kv_replication(q.shape[2], k.shape[2], mesh.ulysses)
    check_sinks(sinks, q.shape[2])
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap!r}")


def _boundaries(q, mesh: SPMesh, cu_seqlens) -> list[int]:
    b, s_local = q.shape[0], q.shape[1]
    s_global = s_local * mesh.sp
    if cu_seqlens is None:
        cu = [i * s_global for i in range(b + 1)]  # each row one document of S = S_local·U·R tokens
    else:
        if b != 1:
            raise ValueError(f"cu_seqlens describes one packed row, but B = {b}")
        cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
        if cu[-1] != s_global:
            raise ValueError(
                f"cu_seqlens ends at {cu[-1]} but S_local({s_local}) x ulysses({mesh.ulysses}) x ring({mesh.ring}) "
                f"= {s_global} tokens are held by the SP group"
            )
    return mesh.check_boundaries(cu)


def check_inputs(q, k, v, mesh: SPMesh, cu_seqlens, window, softcap, sinks=None, plan_cache: dict | None = None):
    """Validate and return (the global document boundaries of the packed stream, their tuple
    key). The boundary checks (linear in the documents) run once per micro-batch when the caller
    keeps a `plan_cache` and passes the SAME boundaries object to every layer (the batch's
    metadata does): the result is kept under the object's identity, holding the object itself."""
    check_tensors(q, k, v, mesh, window, softcap, sinks)
    ident = ("boundaries", id(cu_seqlens), q.shape[0], q.shape[1], mesh.ring, mesh.ulysses, mesh.fpdt_chunks)
    hit = plan_cache.get(ident) if plan_cache is not None and cu_seqlens is not None else None
    if hit is not None and hit[0] is cu_seqlens:
        return hit[1], hit[2]
    cu = _boundaries(q, mesh, cu_seqlens)
    key = tuple(cu)
    if plan_cache is not None and cu_seqlens is not None:
        plan_cache[ident] = (cu_seqlens, cu, key)
    return cu, key


def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: SPMesh,
    *,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    plan_cache: dict | None = None,
    sinks: torch.Tensor | None = None,
    attention_backend: AttentionChoice | None = None,
) -> torch.Tensor:
    """Exact attention over a sequence sharded across the SP group of `mesh`.

    The rows are the global tokens at `mesh.local_indices(cu_seqlens)`.

    Args:
        q: [B, S_local, H, D], this rank's query rows (after RoPE).
        k: [B, S_local, H_kv, D] (GQA not expanded).
        v: [B, S_local, H_kv, D].
        mesh: The mesh the batch was sharded on.
        cu_seqlens: The global document boundaries of the packed sequence (B = 1); None:
            every row is one document.
        causal: Causal attention (each token sees itself and the tokens before it).
        softmax_scale: The logits' scale (default 1/sqrt(D)).
        window: A sliding window: a query at i sees keys j with i - j < window (None: no
            window), as in transformers.
        softcap: Logit soft-capping, softcap·tanh(logits / softcap) (None: none).
        plan_cache: An optional dict the caller keeps per batch, so that the layers of one
            micro-batch plan the ring and choose the kernel once (`patch()` does this).
        sinks: None, or the per-head sink logits [H] (HF's `s_aux`), joined to the softmax
            denominator once (`ops/sinks.py`); differentiable.
        attention_backend: How the local kernel is chosen (`ops/backends/select.AttentionChoice`:
            a named backend, the GPU's measured ranking; None: the unmeasured default), resolved
            before the first collective.

    Returns:
        [B, S_local, H, D], contiguous like HF's own attention functions (models `.view()`
            it).
    """
    qf, kf, vf, spec, kw, sinks, shape = _to_ring(q, k, v, mesh, cu_seqlens, causal, softmax_scale, window, softcap,
                                                   plan_cache, sinks, attention_backend)
    return _from_ring(ring_attention(qf, kf, vf, spec, sinks=sinks, **kw), shape, mesh)


def usp_forward_kept(q, k, v, mesh: SPMesh, **options) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`usp_attention`'s output without a graph, and the ring's merged result it came from: out
    [1, H/U, B·S_ring, D] (q's dtype) and lse [1, H/U, B·S_ring] (fp32), what `usp_replay` takes
    (keep-attention of row-chunked layers). `options`: usp_attention's keywords."""
    qf, kf, vf, spec, kw, sinks, shape = _to_ring(q, k, v, mesh, **options)
    out, lse, _ = ring_forward(qf, kf, vf, spec, sinks=sinks, **kw)
    out = out.to(qf.dtype)  # the one rounding of the merged result, as RingAttention
    return _from_ring(out, shape, mesh), out, lse


def usp_replay(q, k, v, mesh: SPMesh, out: torch.Tensor, lse: torch.Tensor, **options) -> torch.Tensor:
    """`usp_attention` differentiable in q, k, v (and the sinks) whose ring is replaced by its
    kept result (`usp_forward_kept`'s out, lse): the Ulysses all-to-alls run, no attention
    kernel and no ring step; the backward is the ring's (`ops/ring.RingReplay`)."""
    qf, kf, vf, spec, kw, sinks, shape = _to_ring(q, k, v, mesh, **options)
    o = RingReplay.apply(qf, kf, vf, spec, kw["scale"], kw["causal"], kw["window"], kw["softcap"], sinks, out, lse)
    return _from_ring(o, shape, mesh)


def _to_ring(q, k, v, mesh: SPMesh, cu_seqlens=None, causal=True, softmax_scale=None, window=None, softcap=None,
             plan_cache=None, sinks=None, attention_backend=None) -> tuple:
    """Checks, Ulysses all-to-all and the ring's spec: (qf, kf, vf [1, h, B·S_ring, D], spec,
    kernel keywords, local sinks [H/U] or None, (B, S_ring))."""
    if mesh.fpdt_chunks > 1:
        raise ValueError(f"mesh has fpdt_chunks={mesh.fpdt_chunks}: use hf_longctx.ops.fpdt.fpdt_attention")
    cu, cu_key = check_inputs(q, k, v, mesh, cu_seqlens, window, softcap, sinks, plan_cache)
    # Chosen (or refused) before the all-to-all: device, dtype, head dim, softcap and window are
    # the same on every rank, so every rank raises alike and none waits in a collective.
    backend = kernels.batch_backend(q, softcap=softcap, memo=plan_cache, window=window, choice=attention_backend)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    b = q.shape[0]
    if sinks is not None:
        sinks = local_sinks(sinks, mesh)  # [H/U]: the heads this rank computes after the all-to-all
    if mesh.ulysses > 1:
        q, k, v = scatter_heads(q, k, v, mesh.ulysses_group, mesh.ulysses)  # [B, S_ring, H/U, D], [B, S_ring, H_kv'/U, D]
    s_ring = q.shape[1]
    # Rows of one document each are laid end to end: the ring stream of row b is document b's
    # zigzag chunks, so B rows form one packed stream of B documents.
    qf, kf, vf = (t.reshape(1, b * s_ring, t.shape[2], t.shape[3]).transpose(1, 2) for t in (q, k, v))  # [1, h, B·S_ring, D]
    # Every layer of a micro-batch has the same boundaries: the caller may keep the plan
    # (pure Python, linear in the documents) in `plan_cache` for the batch's lifetime.
    key = (cu_key, mesh.ring, mesh.ring_rank, causal, window)
    plan = plan_cache.get(key) if plan_cache is not None else None
    if plan is None:
        plan = ring_plan(cu, mesh.ring, mesh.ring_rank, causal=causal, window=window)
        if plan_cache is not None:
            plan_cache[key] = plan
    spec = RingSpec(
        group=mesh.ring_group,
        ring=mesh.ring,
        ring_rank=mesh.ring_rank,
        next_rank=mesh.global_rank(ring_rank=mesh.ring_rank + 1),
        prev_rank=mesh.global_rank(ring_rank=mesh.ring_rank - 1),
        plan=plan,
        backend=backend,  # chosen once per micro-batch
    )
    return qf, kf, vf, spec, dict(scale=scale, causal=causal, window=window, softcap=softcap), sinks, (b, s_ring)


def _from_ring(out: torch.Tensor, shape: tuple, mesh: SPMesh) -> torch.Tensor:
    """The ring's [1, h, B·S_ring, D] back to the rank's rows [B, S_local, H, D], contiguous."""
    b, s_ring = shape
    out = out.transpose(1, 2).reshape(b, s_ring, out.shape[1], out.shape[3])  # [B, S_ring, H/U, D]
    if mesh.ulysses > 1:
        out = gather_heads(out, mesh.ulysses_group)  # [B, S_local, H, D]
    # HF's attention functions return contiguous outputs and models `.view()` them (AFMoE,
    # JetMoE); the transpose above is a strided view (a no-op copy when already contiguous).
    return out.contiguous()
