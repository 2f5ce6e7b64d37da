"""FPDT: chunked Ulysses attention with online softmax over chunks and host offload (FPDT paper §3.3-3.4).

Where it sits: with `mesh.fpdt_chunks = u > 1` (ring degree 1) the registered attention
calls `fpdt_attention` instead of `usp_attention`. Local chunk i of Ulysses rank j is global
piece i·U + j (`layout.local_runs(..., fpdt_chunks=u)`), so one all-to-all per chunk
gathers the contiguous global segment i for H/U heads (FPDT Figure 6).
Forward: per query chunk, attention over the K/V chunks it may see (`ops/fpdt_schedule.py`),
folded with `ops/lse.py`; finished K/V wait in a `ChunkStore` (`ops/offload.py`). Backward
(§3.4): K/V outer, Q inner, from the final (sink-merged, `ops/sinks.py`) out/lse.
Exact: outputs and gradients equal single-device attention, packed documents included.
Three layers: `fpdt_forward` / `fpdt_backward` → `FPDTAttention` → `fpdt_attention`;
`fpdt_replay_chunks`: the forward loop's bookkeeping with kept outputs (keep-attention)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from hf_longctx.distributed.comm import head_to_seq, seq_to_head
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.ops.backends import AttentionChoice
from hf_longctx.ops import kernels
from hf_longctx.ops.fpdt_schedule import FPDTPlan, plan_for
from hf_longctx.ops.offload import ChunkStore
from hf_longctx.ops.ulysses import replicate_kv
from hf_longctx.ops.math_kernel import acc_dtype
from hf_longctx.ops.sinks import merge_sink, sink_grad
from hf_longctx.ops.usp import local_sinks


def _to_heads(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # [B, S_c, h, D] -> [B, h, S_c, D], the kernel layout (a view)


def _from_heads(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[B, h, S_c, D] -> [B, S_c, h, D] contiguous for the all-to-all, cast to `dtype` in the
    same copy (one rounding, one kernel: no cast then layout copy)."""
    return x.transpose(1, 2).to(dtype=dtype or x.dtype, memory_format=torch.contiguous_format)


def _attend(
    plan: FPDTPlan, store: ChunkStore, i: int, q_i: torch.Tensor, live: dict, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax of query chunk i over its K/V chunks: `live` ones are on the device
    already, the others are streamed from the store, double-buffered, in chunk order.
    The first K/V chunk's result starts one accumulator -- the kernel's own buffer when no
    merge follows, else its one float32 copy -- and the others merge into it in place
    (`kernels.varlen_forward(into=...)`, each read in the kernel's dtype); the sinks join
    once, at the end; the chunk's output is rounded to q's dtype once."""
    acc = acc_dtype(q_i.dtype)
    sole = len(plan.needs[i]) == 1 and sinks is None  # no merge follows: the kernel's result is final
    acc_out = acc_lse = None
    streamed = store.stream([[("kv", j)] for j in plan.needs[i] if j not in live])
    for j in plan.needs[i]:
        if j in live:
            k_j, v_j = live[j]
        else:
            _, (k_j, v_j) = next(streamed)
        kw = dict(out_dtype=acc, widen=False, blocks=plan.tiles[i][j], backend=plan.backend(q_i), **plan.kw)
        if acc_out is None:
            o, acc_lse = kernels.varlen_forward(q_i, k_j, v_j, plan.runs[i], plan.runs[j], **kw)  # [B, h, S_c, D], [B, h, S_c]
            acc_out = o if sole else o.to(acc)
        else:
            kernels.varlen_forward(q_i, k_j, v_j, plan.runs[i], plan.runs[j], into=(acc_out, acc_lse), **kw)
        del k_j, v_j
    for _ in streamed:  # records the last chunk's "end" and frees its device buffer
        pass
    if acc_out is None:  # no allowed key for any row of the chunk
        acc_out, acc_lse = kernels.empty_result(q_i)
    if sinks is not None:  # once per query row, after every K/V chunk (ops/sinks.py)
        acc_out, acc_lse = merge_sink(acc_out, acc_lse, sinks)
    return acc_out.to(q_i.dtype), acc_lse


def fpdt_forward_chunks(
    inputs: Callable[[int], tuple], plan: FPDTPlan, store: ChunkStore, emit: Callable, sinks=None, save: bool = True
) -> None:
    """The forward loop over local row chunks. `inputs(step)` gives local chunk `step` (rows
    [step·c, (step+1)·c)): q [B, c, H, D], k/v [B, c, H_kv', D] (H_kv' divisible by U), asked
    for in chunk order, so a caller can produce them one chunk at a time. `emit(i, o_i, lse_i)`
    receives each finished query chunk in the kernel layout ([B, h, S/u, D] in q's dtype, lse
    [B, h, S/u] fp32) as soon as it is done (causal: at its own step). `sinks`: this rank's
    [H/U] sink logits or None.

    `save`: leave what the backward reads in `store` -- ("q", i), ("kv", j), ("lse", i) --
    each put after the step's own K/V fetches are queued; without `save` (a forward whose
    saved tensors are discarded) only the chunks a later step of this forward reads are put,
    and they are popped at the end (what `FPDTAttention` saves then are `placeholder`s).
    """
    u = plan.chunks
    later_q = [plan.ready_at[i] > i for i in range(u)]  # q_i read again at a later step (non-causal)
    later_kv = [any(j in plan.needs[i] and plan.ready_at[i] > j for i in range(u)) for j in range(u)]
    for step in range(u):
        qh, kh, vh = seq_to_head(list(inputs(step)), plan.group)  # [B, c, H, D] -> [B, S/u, H/U, D] (k, v: H_kv'/U)
        qh, kh, vh = _to_heads(qh), _to_heads(kh), _to_heads(vh)  # [B, h, S/u, D]
        if later_q[step]:
            store.put(("q", step), qh)
        live = {step: (kh, vh)}  # only the newest K/V chunk is on the device; older ones are streamed
        for i in [i for i in range(u) if plan.ready_at[i] == step]:
            store.note("pass", ("q", i))
            q_i = qh if i == step else store.get(("q", i))[0]
            o_i, lse_i = _attend(plan, store, i, q_i, live, sinks)
            store.release(("q", i))
            (store.put if save else store.put_placeholder)(("lse", i), lse_i)
            emit(i, o_i, lse_i)
            del q_i, o_i, lse_i
        if not later_q[step]:  # kept for the backward only: queued after this step's K/V fetches
            (store.put if save else store.put_placeholder)(("q", step), qh)
        # offloaded once this step's query chunks are done with it
        (store.put if save or later_kv[step] else store.put_placeholder)(("kv", step), kh, vh)
        del qh, kh, vh, live
    if not save:
        for key in [("q", i) for i in range(u) if later_q[i]] + [("kv", j) for j in range(u) if later_kv[j]]:
            store.discard(key)


def fpdt_replay_chunks(inputs: Callable[[int], tuple], plan: FPDTPlan, store: ChunkStore, kept: Callable, emit: Callable) -> None:
    """The forward loop without its kernels, for a backward whose outputs were kept: every
    local chunk's q, k, v (`inputs(step)`, recomputed) through its all-to-all into `store`
    (("q", i), ("kv", j)), and each query chunk's kept result `kept(i)` = (o_i, lse_i) (what the
    forward's `emit` got) as ("lse", i) and to `emit(i, o_i, lse_i)`, in the forward's order."""
    for step in range(plan.chunks):
        qh, kh, vh = seq_to_head(list(inputs(step)), plan.group)  # [B, c, H, D] -> [B, S/u, H/U, D] (k, v: H_kv'/U)
        store.put(("q", step), _to_heads(qh))  # [B, h, S/u, D]
        store.put(("kv", step), _to_heads(kh), _to_heads(vh))
        del qh, kh, vh
        for i in [i for i in range(plan.chunks) if plan.ready_at[i] == step]:
            o_i, lse_i = kept(i)
            store.put(("lse", i), lse_i)
            emit(i, o_i, lse_i)  # o_i, lse_i stay referenced by the caller's kept list


def fpdt_forward(q, k, v, plan: FPDTPlan, store: ChunkStore, sinks=None, save: bool = True) -> torch.Tensor:
    """q [B, S_local, H, D], k/v [B, S_local, H_kv', D] → out [B, S_local, H, D], contiguous
    whatever q's strides; `fpdt_forward_chunks` over row slices of the full tensors."""
    c = q.shape[1] // plan.chunks
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # not empty_like: q may be a strided view

    def inputs(step: int) -> tuple:
        rows = slice(step * c, (step + 1) * c)
        return q[:, rows], k[:, rows], v[:, rows]

    def emit(i: int, o_i: torch.Tensor, lse_i: torch.Tensor) -> None:
        (o_seq,) = head_to_seq([_from_heads(o_i)], plan.group)  # [B, S/u, H/U, D] -> [B, c, H, D]
        out[:, i * c : (i + 1) * c] = o_seq

    fpdt_forward_chunks(inputs, plan, store, emit, sinks, save)
    return out


def fpdt_backward_chunks(plan: FPDTPlan, store: ChunkStore, dtype: torch.dtype, emit: Callable, sinks=None):
    """Gradients of the forward from its saved chunks and ("do", i) = (dout_i, out_i) in the
    kernel layout (the final, sink-merged out), both already in `store`: K/V chunks outer,
    query chunks inner. After outer step j, `emit(j, dk_j, dv_j, {i: dq_i})` receives the
    local rows of K/V chunk j and every query chunk i no later K/V chunk touches, in the
    token layout ([B, c, H_kv', D] / [B, c, H, D], `dtype`). Every chunk gradient stays in the
    accumulation dtype until its sum is complete: one rounding per gradient. Returns dsink
    ([H/U] in the accumulation dtype) or None."""
    u = plan.chunks
    acc = acc_dtype(dtype)  # dq sums over K/V chunks, dk/dv over query chunks: round once
    dsink = None if sinks is None else torch.zeros(sinks.shape, dtype=acc, device=sinks.device)
    do_shape = None  # dq_i's; its accumulator starts from the first K/V chunk's gradient (no zeros)
    for j in range(u):
        store.note("pass", ("kv", j))
        if j + 1 < u:
            store.prefetch(("kv", j + 1))  # the next outer chunk comes in while this one is worked on
        k_j, v_j = store.get(("kv", j))
        dk_j = dv_j = None  # [B, h_kv, S/u, D] in acc; the first query chunk's gradient starts the sum (no zeros)
        kv_sole = len(plan.users[j]) == 1  # one query chunk sees K/V chunk j: its gradient is final as it is
        # ("dq", i) exists from the second K/V chunk chunk i needs on (the first one's gradient starts it)
        groups = [[("q", i), ("do", i), ("lse", i)] + ([("dq", i)] if j != plan.needs[i][0] else []) for i in plan.users[j]]
        final: dict[int, torch.Tensor] = {}  # dq of chunks no later K/V chunk touches: kept on the device
        for (key, *_), tensors in store.stream(groups):
            i = key[1]
            q_i, do_i, o_i, lse_i = tensors[:4]
            dq_i = tensors[4] if len(tensors) > 4 else None  # the fetched copy is this step's own: summed in place
            do_shape = do_i.shape
            del tensors
            gq, gk, gv = kernels.varlen_backward(
                do_i, q_i, k_j, v_j, o_i, lse_i, plan.runs[i], plan.runs[j], grad_dtype=acc, blocks=plan.tiles[i][j],
                widen=False, into=(dq_i, dk_j, dv_j), backend=plan.backend(q_i), **plan.kw
            )  # pieces are added into the float32 sums given, in place; the others come back as computed
            if dsink is not None and j == plan.needs[i][0]:  # each query chunk once; chunks with no key have out 0
                dsink += sink_grad(do_i, o_i, lse_i, sinks.to(acc))
            if dq_i is None:  # the sum's start: the piece itself when it is dq's only one, else its float32 copy
                dq_i = gq if len(plan.needs[i]) == 1 else gq.to(acc)
            if plan.dq_done_at[i] == j:
                final[i] = dq_i
            else:
                store.put(("dq", i), dq_i)  # written back (to host when offloading) for later K/V chunks
            if dk_j is None:
                dk_j, dv_j = (gk, gv) if kv_sole else (gk.to(acc), gv.to(acc))
            del q_i, do_i, o_i, lse_i, dq_i, gq, gk, gv  # nothing of this pair outlives it
        if dk_j is None:  # no query chunk sees this K/V chunk
            dk_j, dv_j = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (k_j, v_j))
        del k_j, v_j
        store.pop(("kv", j))
        done = [i for i in range(u) if plan.dq_done_at[i] == j]
        dq_done = []
        for i in done:
            # a chunk with no key at all has no gradient: zeros
            dq_i = final.pop(i) if i in final else torch.zeros(do_shape or dk_j.shape, dtype=acc, device=dk_j.device)
            dq_done.append(_from_heads(dq_i, dtype))  # [B, S/u, H/U, D]
            del dq_i  # the fp32 sum, rounded once above
            for key in (("dq", i), ("q", i), ("do", i), ("lse", i)):
                store.pop(key)
        grads = head_to_seq([_from_heads(dk_j, dtype), _from_heads(dv_j, dtype), *dq_done], plan.group)
        del dk_j, dv_j, dq_done  # each [B, S/u, h, D] -> [B, c, U·h, D]
        emit(j, grads[0], grads[1], dict(zip(done, grads[2:])))
        del grads
    return dsink


def put_dout(plan: FPDTPlan, store: ChunkStore, i: int, dout_i: torch.Tensor, out_i: torch.Tensor) -> None:
    """("do", i) for the backward: local rows chunk i of dout and of the forward's output
    [B, c, H, D], in the kernel layout after one all-to-all."""
    do_i, o_i = seq_to_head([dout_i, out_i], plan.group)  # [B, c, H, D] -> [B, S/u, H/U, D]
    store.put(("do", i), _to_heads(do_i), _to_heads(o_i))  # [B, h, S/u, D]


def fpdt_backward(dout, out, plan: FPDTPlan, store: ChunkStore, q_shape, kv_shape, sinks=None):
    """Gradients (dq [B, S_local, H, D], dk/dv [B, S_local, H_kv', D], dsink [H/U] or None)
    of `fpdt_forward` from its output `out` and the chunks it saved in `store`."""
    c = q_shape[1] // plan.chunks
    for i in range(plan.chunks):  # dout and out chunk i to the head layout, stored next to the chunk's saved tensors
        rows = slice(i * c, (i + 1) * c)
        put_dout(plan, store, i, dout[:, rows], out[:, rows])
    dq, dk, dv = dout.new_empty(q_shape), dout.new_empty(kv_shape), dout.new_empty(kv_shape)

    def emit(j: int, dk_j, dv_j, dq_done: dict) -> None:
        dk[:, j * c : (j + 1) * c], dv[:, j * c : (j + 1) * c] = dk_j, dv_j
        for i, g in dq_done.items():
            dq[:, i * c : (i + 1) * c] = g

    dsink = fpdt_backward_chunks(plan, store, dout.dtype, emit, sinks)
    return dq, dk, dv, dsink


def saved_keys(u: int) -> list:
    return [("q", i) for i in range(u)] + [("kv", j) for j in range(u)] + [("lse", i) for i in range(u)]


class FPDTAttention(torch.autograd.Function):
    """The output and everything else the backward needs go through `save_for_backward` (host
    copies when offloading), so activation checkpointing and saved-tensor hooks see all of it.
    The output is saved in the token layout -- the tensor the next projection saves anyway --
    and goes back to the head layout with dout in the backward's all-to-alls. `save=False`
    (a forward whose saved tensors are discarded: a checkpoint's first run) saves placeholders
    of the same shapes, so the recompute that refills them matches."""

    @staticmethod
    def forward(ctx, q, k, v, plan, offload, sinks, save):
        store = ChunkStore(q.device, offload=offload)
        out = fpdt_forward(q, k, v, plan, store, sinks, save=save)
        keys = saved_keys(plan.chunks)
        ctx.keys, ctx.counts = keys, store.counts(keys)
        ctx.save_for_backward(out, *store.export(keys), *([] if sinks is None else [sinks]))
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
        out, *saved = ctx.saved_tensors
        sinks = saved.pop() if ctx.has_sinks else None
        store = ChunkStore(dout.device, offload=ctx.offload)
        store.load(ctx.keys, ctx.counts, saved)
        ctx.recycled = store.copies  # the store pops (and recycles) every host copy it reads
        dq, dk, dv, dsink = fpdt_backward(dout.contiguous(), out, ctx.plan, store, *ctx.shapes, sinks=sinks)
        return dq, dk, dv, None, None, None if dsink is None else dsink.to(sinks.dtype), None



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
    offload: bool = False, sinks: torch.Tensor | None = None,
    plan_cache: dict | None = None, save: bool = True, attention_backend: AttentionChoice | None = None,
) -> torch.Tensor:
    """Exact attention over a sequence sharded across the Ulysses group, FPDT-chunked.

    Args:
        q: [B, S_local, H, D]: the tokens at `mesh.local_indices(cu_seqlens)` (`mesh.fpdt_chunks` rank-ordinal chunks).
        k: [B, S_local, H_kv, D] (GQA not expanded).
        v: [B, S_local, H_kv, D].
        mesh: The mesh the batch was sharded on (ring degree 1, `fpdt_chunks` > 1); `cu_seqlens`, `causal`,
            `softmax_scale`, `window`, `softcap`, `sinks` and `plan_cache` are `usp_attention`'s.
        offload: Keep finished chunks in pinned host memory on CUDA (no effect on CPU).
        save: False: the caller discards the saved tensors (a checkpointed layer's first run): no chunk is kept.
        attention_backend: The kernel choice (`ops/backends/select.AttentionChoice`), made before any collective.

    Returns:
        [B, S_local, H, D].
    """
    if not isinstance(offload, bool):
        raise ValueError(f"offload must be a bool, got {offload!r}")
    plan = plan_for(q, k, v, mesh, cu_seqlens=cu_seqlens, causal=causal, softmax_scale=softmax_scale, window=window,
                    softcap=softcap, sinks=sinks, plan_cache=plan_cache, choice=attention_backend)
    k, v = replicate_kv(q, k, v, mesh.ulysses)  # [B, S_local, H_kv·f, D]
    if sinks is not None:
        sinks = local_sinks(sinks, mesh)  # [H/U]: the heads of this rank after each chunk's all-to-all
    # Nothing is kept for a backward that cannot come (no grad) or whose saved tensors a
    # checkpoint discards and recomputes (`save=False`, the caller's knowledge).
    save = save and torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks))
    return FPDTAttention.apply(q, k, v, plan, offload, sinks, save)
