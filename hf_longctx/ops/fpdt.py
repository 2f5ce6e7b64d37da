"""FPDT: chunked Ulysses attention with online softmax over chunks and host offload (FPDT paper §3.3-3.4).

Where it sits: with `mesh.fpdt_chunks = u > 1` the attention registered with HF calls
`fpdt_attention` instead of `usp_attention` (ring degree is 1). Rank j of the Ulysses
group holds the rank-ordinal layout of `data/layout.local_runs(..., fpdt_chunks=u)`:
local chunk i (rows [i·c, (i+1)·c), c = S_local/u) is global piece i·U + j, so one
all-to-all of local chunk i gathers the contiguous global segment i
(`layout.fpdt_chunk_range`) for H/U heads (FPDT Figure 6).

Forward (FPDT §3.3): for chunk i = 0..u-1: all-to-all of q_i, k_i, v_i; the attention of
q_i over the K/V chunks it may see (for causal, 0..i; `blocks.plan_blocks` skips chunks
with no allowed pair, packed documents included) folded with the one LSE merge
(`ops/lse.py`); out_i goes back with the inverse all-to-all. Finished K/V chunks wait in
a `ChunkStore` (`ops/offload.py`): pinned host memory on CUDA with `offload=True`, fetched
back double-buffered for each later query chunk. Without causality (or with a window that
reaches forward) a query chunk may need later K/V chunks: it is computed as soon as the
last one it needs has been exchanged, which for causal masks is its own step.

Attention sinks (`ops/sinks.py`): a query chunk's sink logit joins its denominator once,
after its last K/V chunk; the backward runs from that sink-merged out/lse.

Backward (FPDT §3.4): nested loops from the final out/lse, K/V outer and Q inner. For K/V
chunk j, every query chunk i that saw it is streamed in (q_i, dout_i, out_i, lse_i and the
dq_i accumulator); dk_j/dv_j are complete after the inner loop and travel back with one
all-to-all, together with every dq_i that no later K/V chunk touches.

Three layers: `fpdt_forward` / `fpdt_backward` loops → `FPDTAttention` Function →
`fpdt_attention` functional wrapper (same inputs and checks as `usp_attention`).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from hf_longctx.data.layout import Run, fpdt_chunk_range, runs_of_range
from hf_longctx.distributed.comm import head_to_seq, seq_to_head
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.ops import blocks, kernels
from hf_longctx.ops.lse import merge
from hf_longctx.ops.offload import ChunkStore
from hf_longctx.ops.ulysses import replicate_kv
from hf_longctx.ops.math_kernel import acc_dtype
from hf_longctx.ops.sinks import merge_sink, sink_grad
from hf_longctx.ops.usp import check_inputs, local_sinks


class FPDTPlan:
    """The chunk schedule, identical on every rank: the runs of every global segment and,
    per query chunk, the K/V chunks holding an allowed pair."""

    def __init__(self, cu: Sequence[int], chunks: int, *, group, causal: bool, window: int | None, kw: dict):
        self.group, self.chunks, self.kw = group, chunks, kw
        total = cu[-1]
        self.runs: list[list[Run]] = [runs_of_range(cu, *fpdt_chunk_range(total, chunks, i)) for i in range(chunks)]
        # tiles[i][j]: the (query chunk i, K/V chunk j) tiles, planned once per micro-batch
        self.tiles: list[list[blocks.Tiles]] = [
            [blocks.Tiles(blocks.plan_blocks(self.runs[i], self.runs[j], causal=causal, window=window)) for j in range(chunks)]
            for i in range(chunks)
        ]
        self.needs: list[list[int]] = [[j for j in range(chunks) if self.tiles[i][j]] for i in range(chunks)]
        # A query chunk is computed at the step its last needed K/V chunk arrives (its own
        # step at the latest, so its q need not be stored for causal masks).
        self.ready_at = [max(need + [i]) for i, need in enumerate(self.needs)]
        # Backward: dq_i is complete after the outer step of the last K/V chunk it needs.
        self.dq_done_at = [max(need) if need else 0 for need in self.needs]
        self.users = [[i for i in range(chunks) if j in self.needs[i]] for j in range(chunks)]


def _to_heads(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # [B, S_c, h, D] -> [B, h, S_c, D], the kernel layout (a view)


def _from_heads(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).contiguous()  # [B, h, S_c, D] -> [B, S_c, h, D] for the all-to-all


def _attend(
    plan: FPDTPlan, store: ChunkStore, i: int, q_i: torch.Tensor, live: dict, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax of query chunk i over its K/V chunks: `live` ones are on the device
    already, the others are streamed from the store, double-buffered, in chunk order.
    Partial results stay in the accumulation dtype; the sinks join once, at the end; the
    chunk's output is rounded to q's dtype once."""
    acc = acc_dtype(q_i.dtype)
    acc_out = acc_lse = None
    streamed = store.stream([[("kv", j)] for j in plan.needs[i] if j not in live])
    for j in plan.needs[i]:
        if j in live:
            k_j, v_j = live[j]
        else:
            _, (k_j, v_j) = next(streamed)
        o, l = kernels.varlen_forward(q_i, k_j, v_j, plan.runs[i], plan.runs[j], out_dtype=acc, blocks=plan.tiles[i][j], **plan.kw)  # [B, h, S_c, D], [B, h, S_c]
        acc_out, acc_lse = (o, l) if acc_out is None else merge(acc_out, acc_lse, o, l)
        del k_j, v_j
    for _ in streamed:  # records the last chunk's "end" and frees its device buffer
        pass
    if acc_out is None:  # no allowed key for any row of the chunk
        acc_out, acc_lse = kernels.empty_result(q_i)
    if sinks is not None:  # once per query row, after every K/V chunk (ops/sinks.py)
        acc_out, acc_lse = merge_sink(acc_out, acc_lse, sinks)
    return acc_out.to(q_i.dtype), acc_lse


def fpdt_forward(q, k, v, plan: FPDTPlan, store: ChunkStore, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, S_local, H, D], k/v [B, S_local, H_kv', D] (H_kv' divisible by U) → out [B, S_local, H, D],
    contiguous whatever q's strides. `sinks`: this rank's [H/U] sink logits or None.

    Leaves in `store`, for the backward: ("q", i) q_i, ("kv", j) (k_j, v_j) and ("o", i)
    (out_i, lse_i), in the kernel layout [B, h, S/u, D] (lse [B, h, S/u]).
    """
    u, c = plan.chunks, q.shape[1] // plan.chunks
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # not empty_like: q may be a strided view
    for step in range(u):
        rows = slice(step * c, (step + 1) * c)
        qh, kh, vh = seq_to_head([q[:, rows], k[:, rows], v[:, rows]], plan.group)  # [B, S/u, H/U, D], [B, S/u, H_kv'/U, D]
        qh, kh, vh = _to_heads(qh), _to_heads(kh), _to_heads(vh)  # [B, h, S/u, D]
        store.put(("q", step), qh)
        live = {step: (kh, vh)}  # only the newest K/V chunk is on the device; older ones are streamed
        for i in [i for i in range(u) if plan.ready_at[i] == step]:
            store.note("pass", ("q", i))
            q_i = qh if i == step else store.get(("q", i))[0]
            o_i, lse_i = _attend(plan, store, i, q_i, live, sinks)
            store.release(("q", i))
            store.put(("o", i), o_i, lse_i)
            (o_seq,) = head_to_seq([_from_heads(o_i)], plan.group)  # [B, S/u, H/U, D] -> [B, c, H, D]
            out[:, i * c : (i + 1) * c] = o_seq
        store.put(("kv", step), kh, vh)  # offloaded once this step's query chunks are done with it
        del qh, kh, vh, live
    return out


def fpdt_backward(dout: torch.Tensor, plan: FPDTPlan, store: ChunkStore, q_shape, kv_shape, sinks=None):
    """Gradients (dq [B, S_local, H, D], dk/dv [B, S_local, H_kv', D], dsink [H/U] or None)
    of `fpdt_forward` from the final (sink-merged) out/lse held in `store`: K/V chunks
    outer, query chunks inner. Every chunk gradient stays in the accumulation dtype until
    its sum is complete: one rounding per gradient."""
    u = plan.chunks
    c = q_shape[1] // u
    dtype = dout.dtype
    acc = acc_dtype(dtype)  # dq sums over K/V chunks, dk/dv over query chunks: round once
    dq, dk, dv = dout.new_empty(q_shape), dout.new_empty(kv_shape), dout.new_empty(kv_shape)
    dsink = None if sinks is None else torch.zeros(sinks.shape, dtype=acc, device=sinks.device)
    for i in range(u):  # dout chunk i to the head layout, stored next to the chunk's saved tensors
        (do_i,) = seq_to_head([dout[:, i * c : (i + 1) * c]], plan.group)  # [B, c, H, D] -> [B, S/u, H/U, D]
        do_i = _to_heads(do_i)  # [B, h, S/u, D]
        store.put(("do", i), do_i)
        do_shape = do_i.shape  # dq_i's; its accumulator starts from the first K/V chunk's gradient (no zeros)
        del do_i
    for j in range(u):
        store.note("pass", ("kv", j))
        if j + 1 < u:
            store.prefetch(("kv", j + 1))  # the next outer chunk comes in while this one is worked on
        k_j, v_j = store.get(("kv", j))
        dk_j = torch.zeros(k_j.shape, dtype=acc, device=k_j.device)  # [B, h_kv, S/u, D]
        dv_j = torch.zeros(v_j.shape, dtype=acc, device=v_j.device)
        # ("dq", i) exists from the second K/V chunk chunk i needs on (the first one's gradient starts it)
        groups = [[("q", i), ("do", i), ("o", i)] + ([("dq", i)] if j != plan.needs[i][0] else []) for i in plan.users[j]]
        final: dict[int, torch.Tensor] = {}  # dq of chunks no later K/V chunk touches: kept on the device
        for (key, *_), tensors in store.stream(groups):
            i = key[1]
            q_i, do_i, o_i, lse_i = tensors[:4]
            dq_i = tensors[4] if len(tensors) > 4 else None
            del tensors
            gq, gk, gv = kernels.varlen_backward(
                do_i, q_i, k_j, v_j, o_i, lse_i, plan.runs[i], plan.runs[j], grad_dtype=acc, blocks=plan.tiles[i][j], **plan.kw
            )
            if dsink is not None and j == plan.needs[i][0]:  # each query chunk once; chunks with no key have out 0
                dsink += sink_grad(do_i, o_i, lse_i, sinks.to(acc))
            dq_i = gq if dq_i is None else dq_i + gq
            if plan.dq_done_at[i] == j:
                final[i] = dq_i
            else:
                store.put(("dq", i), dq_i)  # written back (to host when offloading) for later K/V chunks
            dk_j += gk
            dv_j += gv
            del q_i, do_i, o_i, lse_i, dq_i
        del k_j, v_j
        store.pop(("kv", j))
        done = [i for i in range(u) if plan.dq_done_at[i] == j]
        dq_done = []
        for i in done:
            # a chunk with no key at all has no gradient: zeros
            dq_i = final.pop(i) if i in final else torch.zeros(do_shape, dtype=acc, device=dout.device)
            dq_done.append(_from_heads(dq_i.to(dtype)))  # [B, S/u, H/U, D]
            for key in (("dq", i), ("q", i), ("do", i), ("o", i)):
                store.pop(key)
        grads = head_to_seq([_from_heads(dk_j.to(dtype)), _from_heads(dv_j.to(dtype)), *dq_done], plan.group)
        del dk_j, dv_j, dq_done  # each [B, S/u, h, D] -> [B, c, U·h, D]
        dk[:, j * c : (j + 1) * c], dv[:, j * c : (j + 1) * c] = grads[0], grads[1]
        for i, g in zip(done, grads[2:]):
            dq[:, i * c : (i + 1) * c] = g
    return dq, dk, dv, dsink


def _saved_keys(u: int) -> list:
    return [("q", i) for i in range(u)] + [("kv", j) for j in range(u)] + [("o", i) for i in range(u)]


class FPDTAttention(torch.autograd.Function):
    """Everything the backward needs goes through `save_for_backward` (host copies when
    offloading), so activation checkpointing and saved-tensor hooks see all of it."""

    @staticmethod
    def forward(ctx, q, k, v, plan, offload, sinks):
        store = ChunkStore(q.device, offload=offload)
        out = fpdt_forward(q, k, v, plan, store, sinks)
        keys = _saved_keys(plan.chunks)
        ctx.keys, ctx.counts = keys, store.counts(keys)
        ctx.save_for_backward(*store.export(keys), *([] if sinks is None else [sinks]))
        ctx.plan, ctx.offload, ctx.shapes = plan, offload, (q.shape, k.shape)
        ctx.has_sinks = sinks is not None
        return out

    @staticmethod
    def backward(ctx, dout):
        if getattr(ctx, "recycled", False):
            raise RuntimeError(
                "FPDT attention with offload=True hands its pinned host buffers back to the pool in its backward, "
                "so its graph cannot be run backward twice (retain_graph=True); use offload=False "
                "(patch(..., kv_offload=False)) for a second backward through the same graph"
            )
        saved = ctx.saved_tensors
        sinks = saved[-1] if ctx.has_sinks else None
        saved = saved[:-1] if ctx.has_sinks else saved
        store = ChunkStore(dout.device, offload=ctx.offload)
        store.load(ctx.keys, ctx.counts, saved)
        ctx.recycled = store.copies  # the store pops (and recycles) every host copy it reads
        dq, dk, dv, dsink = fpdt_backward(dout.contiguous(), ctx.plan, store, *ctx.shapes, sinks=sinks)
        return dq, dk, dv, None, None, None if dsink is None else dsink.to(sinks.dtype)


def make_plan(mesh: SPMesh, cu: Sequence[int], *, scale: float, causal: bool, window, softcap) -> FPDTPlan:
    kw = dict(scale=scale, causal=causal, window=window, softcap=softcap)
    return FPDTPlan(cu, mesh.fpdt_chunks, group=mesh.ulysses_group, causal=causal, window=window, kw=kw)


def fpdt_attention(
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
    offload: bool = False,
    sinks: torch.Tensor | None = None,
    plan_cache: dict | None = None,
) -> torch.Tensor:
    """Exact attention over a sequence sharded across the Ulysses group, FPDT-chunked.

    q [B, S_local, H, D], k/v [B, S_local, H_kv, D] → [B, S_local, H, D]. The rows are the
    global tokens at `mesh.local_indices(cu_seqlens)` (rank-ordinal chunk layout with
    `mesh.fpdt_chunks` chunks); `cu_seqlens` are the global document boundaries of the
    packed sequence (B = 1), None = every row is one document. `offload=True` keeps
    finished chunks in pinned host memory on CUDA (no effect on CPU). `sinks`: None, or
    the per-head sink logits [H] (HF's `s_aux`), joined to every query row's softmax
    denominator once, after its last K/V chunk (`ops/sinks.py`); differentiable.
    `plan_cache`: an optional dict the caller keeps per batch, so that the layers of one
    micro-batch share one chunk plan (and the device tensors backends derive from its
    tiles); `patch()` does this.
    """
    if mesh.ring != 1:
        raise ValueError(f"fpdt_attention needs ring degree 1, got ring {mesh.ring} (fpdt_chunks {mesh.fpdt_chunks})")
    if not isinstance(offload, bool):
        raise ValueError(f"offload must be a bool, got {offload!r}")
    u = mesh.fpdt_chunks
    if q.dim() == 4 and (q.shape[1] == 0 or q.shape[1] % u):
        raise ValueError(
            f"S_local ({q.shape[1]}) must be a positive multiple of fpdt_chunks ({u}): every rank cuts its "
            f"tokens into {u} equal chunks (packed length = S_local x ulysses({mesh.ulysses}))"
        )
    cu = check_inputs(q, k, v, mesh, cu_seqlens, window, softcap, sinks)
    if cu_seqlens is None:
        cu = [0, q.shape[1] * mesh.ulysses]  # the same single-document layout in every batch row
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    k, v = replicate_kv(q, k, v, mesh.ulysses)  # [B, S_local, H_kv·f, D]
    # Every layer of a micro-batch has the same boundaries: one plan per batch (pure Python).
    key = ("fpdt", tuple(cu), u, id(mesh.ulysses_group), scale, causal, window, softcap)
    plan = plan_cache.get(key) if plan_cache is not None else None
    if plan is None:
        plan = make_plan(mesh, cu, scale=scale, causal=causal, window=window, softcap=softcap)
        if plan_cache is not None:
            plan_cache[key] = plan
    if sinks is not None:
        sinks = local_sinks(sinks, mesh)  # [H/U]: the heads of this rank after each chunk's all-to-all
    return FPDTAttention.apply(q, k, v, plan, offload, sinks)
