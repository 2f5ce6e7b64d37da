"""One call of a row-chunked decoder layer: its forward and its backward (memory="max").

Where it sits: `integrations/layer_split.LayerSplit.call` builds a `LayerRun` per decoder-layer
call and applies its `ChunkedLayer` (one autograd node: inputs (hidden states, *parameters)); the
run cuts the call's per-token arguments to row chunks (`rows`) and drives the pre-attention and
post-attention runs of `LayerSplit` and FPDT's chunk loops (`ops/fpdt.fpdt_forward_chunks`,
`fpdt_backward_chunks`) in the order the module docstring of `layer_split.py` describes. With
`patch(keep_attention=True)` the forward parks the attention's merged output and LSE with the
layer input and the backward replays them (`AttentionCall.replay`, `ops/fpdt.fpdt_replay_chunks`)
instead of running the attention's forward again. FPDT §3.3-3.5."""

from __future__ import annotations

import math

import torch

from hf_longctx.distributed.comm import head_to_seq, seq_to_head
from hf_longctx.integrations.checkpointing import Inputs, park
from hf_longctx.integrations.layer_rows import kwargs_rows as _rows, row_bounds as _bounds
from hf_longctx.integrations.unread_outputs import learn_unread
from hf_longctx.ops.fpdt import from_heads as _from_heads, to_heads as _to_heads, fpdt_backward_chunks, fpdt_forward_chunks, fpdt_replay_chunks
from hf_longctx.ops.fpdt_schedule import plan_for
from hf_longctx.ops.grad_sums import GradSums
from hf_longctx.ops.offload import ChunkStore
from hf_longctx.ops.tiling import OWNED_GRAD
from hf_longctx.ops.ulysses import replicate_kv
from hf_longctx.ops.usp import local_sinks


class LayerRun:
    """One call of one decoder layer: its forward, then its backward (see the module docstring)."""

    # `LayerSplit` is named, not imported: layer_split imports this module
    def __init__(self, split: LayerSplit, layer, forward, kwargs, params, streams,  # noqa: F821
                 keep: bool = False) -> None:
        self.split, self.layer, self.forward, self.kwargs, self.params = split, layer, forward, kwargs, params
        self.streams, self.keep = streams, keep  # keep: the input stays on the device (not parked on the host)
        self.call = None  # the attention's arguments, from the first pre-attention run
        self.kept_chunks: list[int] = []  # keep_attention with FPDT: the kept (o_i, lse_i) in this order of i

    def pre(self, lo: int, hi: int, h: torch.Tensor) -> tuple:
        return self.split.pre(self.forward, h, _rows(self.kwargs, self.s, lo, hi))

    def post(self, lo: int, hi: int, h: torch.Tensor, a: torch.Tensor, recorded: list | None = None) -> torch.Tensor:
        return self.split.post(self.forward, h, _rows(self.kwargs, self.s, lo, hi), a, self.layer, recorded)

    # ---- forward ---------------------------------------------------------------------------------
    def run_forward(self, h: torch.Tensor, first: bool, save: bool = True) -> torch.Tensor:
        """The layer's output on `h`, row chunk by row chunk; `save`: park the input for the
        backward (False: a forward without gradients, e.g. a frozen reference's: nothing kept)."""
        split = self.split
        self.s, self.needs_h, self.keeping = h.shape[1], h.requires_grad, save and split.state.options.keep_attention
        self.device_type = h.device.type
        self.autocast = dict(enabled=torch.is_autocast_enabled(self.device_type),
                             dtype=torch.get_autocast_dtype(self.device_type))
        if save:
            self.inputs = Inputs([h], [park(h, self.streams, self.keep)], None if first else split.chain.last)
            split.chain.last = self.inputs
        # Row views of h taken here (grad off) would still claim requires_grad without a grad_fn,
        # which autograd hooks on a sub-module's inputs (torch's ModTracker) cannot follow.
        h = h.detach()
        out = torch.empty_like(h)  # [B, S, hidden], written row chunk by row chunk
        rows0 = self._first_rows()
        *qkv0, self.call = self.pre(0, rows0, h[:, :rows0])
        if self.call.mesh.fpdt_chunks > 1:
            box = [tuple(qkv0)]  # handed over: the FPDT loop drops chunk 0's q, k, v once it used them
            del qkv0
            self._fpdt(h, box, out=out)
        else:
            q, k, v = self._qkv_full(h, tuple(qkv0))
            del qkv0
            if self.keeping:  # the ring's merged out and lse wait for the backward with the input
                a, *kept = self.call.run_kept(q, k, v)  # [B, S, H, D_v]; [1, H/U, S_ring, D], [1, H/U, S_ring]
                self._keep(kept)
            else:
                a = self.call.run(q, k, v, save=False)  # [B, S, H, D_v]
            del q, k, v
            for lo, hi in _bounds(0, self.s, self.chunks):
                out[:, lo:hi] = self.post(lo, hi, h[:, lo:hi], a[:, lo:hi])
        if save:
            self.inputs.box[:] = self.inputs.parked  # from now on only the backward reads the input
        return out

    def _keep(self, tensors: list) -> None:
        """Park `tensors` with the layer input (host copies where the device offloads): the
        backward reads them with it, and the layer after prefetches them with it."""
        self.inputs.box.extend(tensors)
        self.inputs.parked.extend(park(t, self.streams) for t in tensors)

    def _first_rows(self) -> int:
        """Rows of the first chunk: an FPDT chunk when the batch's mesh has chunks, else a layer chunk."""
        from hf_longctx.data.sharding import SP_METADATA_KEY
        from hf_longctx.integrations.attention import batch_mesh

        info = self.kwargs.get(SP_METADATA_KEY)
        u = batch_mesh(self.split.state, info).fpdt_chunks if info is not None else 1
        return self.s // u if u > 1 else _bounds(0, self.s, self.chunks)[0][1]

    def _qkv_full(self, h: torch.Tensor, first: tuple) -> tuple:
        """q, k, v of every row ([B, S, H(_kv), D]) from pre per row chunk, without a graph."""
        n0 = first[0].shape[1]
        full = [torch.empty((t.shape[0], self.s, *t.shape[2:]), dtype=t.dtype, device=t.device) for t in first]
        for t, f in zip(full, first):
            t[:, :n0] = f
        for lo, hi in [(lo, hi) for lo, hi in _bounds(0, self.s, self.chunks) if lo >= n0]:  # the layer's row chunks
            with torch.no_grad():
                for t, f in zip(full, self.pre(lo, hi, h[:, lo:hi])[:3]):
                    t[:, lo:hi] = f
        return tuple(full)

    # ---- FPDT: the chunk loop with the token-wise parts inside ------------------------------------
    def _fpdt(self, h, box: list, out=None, dh=None, store=None, acc=None, kept=None):
        """Forward (`out` given, nothing saved but the chunks' (o_i, lse_i) with keep_attention)
        or the backward's recompute (`dh` given: post's backward per finished chunk, its dout put
        into `store`; with `kept`, the forward's (o_i, lse_i) instead of the attention kernels);
        `box`: [chunk 0's (q, k, v)], emptied when the loop takes them. Returns (plan, sinks)."""
        call, mesh, kw = self.call, self.call.mesh, self.call.kw
        u = mesh.fpdt_chunks
        c = self.s // u
        meta = [torch.empty((t.shape[0], self.s, *t.shape[2:]), dtype=t.dtype, device="meta") for t in box[0]]
        plan = plan_for(*meta, mesh, cu_seqlens=kw["cu_seqlens"], causal=kw["causal"], softmax_scale=kw["softmax_scale"],
                        window=kw["window"], softcap=kw["softcap"], sinks=kw["sinks"], plan_cache=call.plan_cache, choice=kw.get("attention_backend"))
        plan.backend(box[0][0])  # chosen (or refused) on every rank alike before the first chunk's all-to-all
        sinks = None if kw["sinks"] is None else local_sinks(kw["sinks"].detach(), mesh)  # [H/U]
        pieces = max(1, math.ceil(self.chunks / u))  # post's row chunks per FPDT chunk

        def inputs(step: int) -> tuple:
            q, k, v = box.pop() if step == 0 else self.pre(step * c, (step + 1) * c, h[:, step * c : (step + 1) * c])[:3]
            return (q, *replicate_kv(q, k, v, mesh.ulysses))  # [B, c, H, D], [B, c, H_kv', D]

        def emit(i: int, o_i: torch.Tensor, lse_i: torch.Tensor) -> None:
            (o_seq,) = head_to_seq([_from_heads(o_i)], plan.group)  # [B, S/u, H/U, D] -> [B, c, H, D]
            a = o_seq[..., : call.d_v]
            if out is not None:
                if self.keeping:
                    self._keep([o_i, lse_i])  # [B, h, S/u, D], [B, h, S/u]
                    self.kept_chunks.append(i)  # the order the loop finished the query chunks in
                for lo, hi in _bounds(i * c, (i + 1) * c, pieces):
                    out[:, lo:hi] = self.post(lo, hi, h[:, lo:hi], a[:, lo - i * c : hi - i * c])
                return
            da = torch.zeros_like(o_seq) if call.d_v < o_seq.shape[-1] else torch.empty_like(o_seq)  # [B, c, H, D]
            for lo, hi in _bounds(i * c, (i + 1) * c, pieces):
                self._post_backward(lo, hi, h, a[:, lo - i * c : hi - i * c], dh, acc,
                                    da[:, lo - i * c : hi - i * c, ..., : call.d_v])
            (do_i,) = seq_to_head([da], plan.group)  # [B, c, H, D] -> [B, S/u, H/U, D]
            store.put(("do", i), _to_heads(do_i), o_i)  # o_i: the sink-merged output, kernel layout

        with torch.no_grad():
            if kept:
                at = {i: 2 * n for n, i in enumerate(self.kept_chunks)}
                fpdt_replay_chunks(inputs, plan, store, lambda i: kept[at[i] : at[i] + 2], emit)
            else:
                fpdt_forward_chunks(inputs, plan, store or ChunkStore(h.device, offload=call.offload), emit, sinks,
                                    save=out is None)
        return plan, sinks

    # ---- backward ----------------------------------------------------------------------------------
    def run_backward(self, dh_out: torch.Tensor, needs: tuple) -> tuple:
        split, streams = self.split, self.streams
        now = {id(p) for p in self.layer.parameters() if p.requires_grad}
        if now != {id(p) for p in self.params}:  # gradients are taken w.r.t. the forward's parameter tensors
            raise RuntimeError(
                f"memory='max': {type(self.layer).__name__}'s parameters are other tensors in the backward than in the "
                "forward (a wrapper that swaps parameter objects, e.g. FSDP1 flat parameters); use FSDP2 (fully_shard) or "
                "patch with checkpoint='attention'")
        h, *kept = self.inputs.read(streams)  # the parked input (and kept attention), back on the device
        if self.call.mesh.fpdt_chunks > 1:  # FPDT keeps O(chunk) of the attention: prefetch at once
            self._prefetch()
        if split.chain.last is self.inputs:
            split.chain.last = None
        # The gradient flowing through the layer, rewritten in place row chunk by row chunk: the
        # incoming buffer itself when a chunked layer (or chunked norm) above made it for us alone.
        dh = dh_out if getattr(dh_out, OWNED_GRAD, False) and dh_out.dtype == h.dtype else dh_out.to(
            h.dtype, memory_format=torch.contiguous_format, copy=True)
        acc = GradSums(self.params, needs)  # one fp32 sum per parameter; the projections GEMM into it
        self.needs_params = needs
        with torch.autocast(self.device_type, **self.autocast), split.slot.bound(acc):
            if self.call.mesh.fpdt_chunks > 1:
                self._fpdt_backward(h, dh, acc, kept)
            else:
                self._usp_backward(h, dh, acc, kept)
        grads = acc.grads()
        if not self.needs_h:
            return None, grads
        setattr(dh, OWNED_GRAD, True)  # only the layer below reads it: it may rewrite it in place
        return dh, grads

    def _prefetch(self) -> None:
        """Start the copy of the input of the layer the backward reaches next."""
        if self.inputs.previous is not None:
            self.inputs.previous.prefetch(self.streams)
            self.inputs.previous = None

    def _grad(self, outputs, grad_outputs, h_rows, extra=()) -> list:
        """autograd.grad of `outputs` w.r.t. (h_rows if the layer input needs it, *extra, params)."""
        live = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
        wrt = ([h_rows] if self.needs_h else []) + list(extra) + [p for p, n in zip(self.params, self.needs_params) if n]
        if not live or not wrt:
            return [None] * len(wrt)
        return list(torch.autograd.grad([o for o, _ in live], wrt, [g for _, g in live], allow_unused=True))

    def _collect(self, grads: list, acc: GradSums) -> None:
        """Add the parameter gradients of one chunk (the tail of `grads`) into the fp32 sums
        (None for the projections' weights: their GEMMs wrote into the sums already)."""
        idx = [i for i, n in enumerate(self.needs_params) if n]
        for i, g in zip(idx, grads[len(grads) - len(idx):]):
            if g is not None:
                acc.add(i, g)

    def _post_backward(self, lo: int, hi: int, h, a_rows, dh, acc, da_rows, learn: bool | None = None) -> None:
        """post(rows) and its backward: dh[rows] becomes the gradient at the attention's residual
        (in place), the parameter gradients join `acc`, the attention output's gradient goes
        into `da_rows`. `learn`: also find the projections post may skip (`LayerSplit.learn`)."""
        if learn is None and id(self.layer) not in self.split.skippable and hi - lo > 1:
            # learnt on the last row, after the others: its one-row graph is all the edges keep alive
            self._post_backward(lo, hi - 1, h, a_rows[:, :-1], dh, acc, da_rows[:, :-1], learn=False)
            return self._post_backward(hi - 1, hi, h, a_rows[:, -1:], dh, acc, da_rows[:, -1:], learn=True)
        learn = id(self.layer) not in self.split.skippable if learn is None else learn
        recorded = [] if learn else None
        with torch.enable_grad():
            h_rows = h[:, lo:hi].detach().requires_grad_(self.needs_h)
            a = a_rows.detach().requires_grad_()
            out = self.post(lo, hi, h_rows, a, recorded)
            grads = self._grad([out], [dh[:, lo:hi]], h_rows, extra=[a] + [r[1] for r in recorded or ()])
        if self.needs_h:
            dh[:, lo:hi] = grads.pop(0)
        da = grads.pop(0)
        if learn:
            self.split.learn(self.layer, recorded, [grads.pop(0) for _ in recorded])
        self._collect(grads, acc)
        da_rows.zero_() if da is None else da_rows.copy_(da)

    def _pre_grads(self, lo: int, hi: int, h, dqkv: tuple, replicate: bool) -> list:
        """pre(rows) with gradients and its backward from (dq, dk, dv): `_grad`'s list."""
        with torch.enable_grad():
            h_rows = h[:, lo:hi].detach().requires_grad_(self.needs_h)
            q, k, v, _ = self.pre(lo, hi, h_rows)
            if replicate:
                k, v = replicate_kv(q, k, v, self.call.mesh.ulysses)
            return self._grad([q, k, v], dqkv, h_rows)

    def _pre_backward(self, lo: int, hi: int, h, dqkv: tuple, dh, acc, replicate: bool) -> None:
        """pre(rows)'s backward into dh[rows] and the sums; the projections whose outputs no
        backward of pre reads (`LayerSplit.unread`) run no forward GEMM."""
        split = self.split
        unread = split.unread.get(id(self.layer))
        if unread is None:  # learnt on the layer's first rows (`integrations/unread_outputs.py`)
            unread = split.unread[id(self.layer)] = learn_unread(
                split.slot, self.params, self.needs_params, lambda: self._pre_grads(lo, hi, h, dqkv, replicate))
        with split.slot.unread_outputs(unread):
            grads = self._pre_grads(lo, hi, h, dqkv, replicate)
        if self.needs_h and grads[0] is not None:
            dh[:, lo:hi].add_(grads.pop(0))  # on the row view: `+=` would then copy the rows onto themselves
        elif self.needs_h:
            grads.pop(0)
        self._collect(grads, acc)

    def _sink_grad(self, dsink: torch.Tensor | None, acc: GradSums) -> None:
        sinks = self.call.kw["sinks"]
        if dsink is None or not sinks.requires_grad:
            return
        with torch.enable_grad():
            local = local_sinks(sinks, self.call.mesh)  # [H/U], a differentiable slice of the parameter
            (g,) = torch.autograd.grad(local, [sinks], dsink.to(local.dtype))
        for i in [i for i, p in enumerate(self.params) if p is sinks]:
            acc.add(i, g)

    def _fpdt_backward(self, h, dh, acc, kept: list) -> None:
        store = ChunkStore(h.device, offload=self.call.offload)
        u, c = self.call.mesh.fpdt_chunks, self.s // self.call.mesh.fpdt_chunks
        pieces = max(1, math.ceil(self.chunks / u))
        with torch.no_grad():
            box = [self.pre(0, c, h[:, :c])[:3]]
        dtype = box[0][0].dtype
        plan, sinks = self._fpdt(h, box, dh=dh, store=store, acc=acc, kept=kept)
        rows: dict[int, dict] = {}

        def emit(j: int, dk_j, dv_j, dq_done: dict) -> None:
            rows.setdefault(j, {}).update(dk=dk_j, dv=dv_j)
            for i, g in dq_done.items():
                rows.setdefault(i, {})["dq"] = g
            for r in [r for r, d in rows.items() if len(d) == 3]:
                d = rows.pop(r)
                for lo, hi in _bounds(r * c, (r + 1) * c, pieces):  # pre's row chunks inside FPDT chunk r
                    part = tuple(d[n][:, lo - r * c : hi - r * c] for n in ("dq", "dk", "dv"))
                    self._pre_backward(lo, hi, h, part, dh, acc, replicate=True)

        dsink = fpdt_backward_chunks(plan, store, dtype, emit, sinks)
        self._sink_grad(dsink, acc)

    def _usp_backward(self, h, dh, acc, kept: list) -> None:
        chunks = _bounds(0, self.s, self.chunks)
        with torch.no_grad():
            first = self.pre(*chunks[0], h[:, : chunks[0][1]])[:3]
            q, k, v = self._qkv_full(h, first)
            del first
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        sinks = self.call.kw["sinks"]
        with torch.enable_grad():  # [B, S, H, D_v], with its autograd graph; kept: no attention kernel again
            a = self.call.replay(q, k, v, *kept) if kept else self.call.run(q, k, v)
        kept.clear()  # the replay's graph holds them until the attention's backward; no longer
        da = torch.empty_like(a)
        for lo, hi in chunks:
            self._post_backward(lo, hi, h, a[:, lo:hi], dh, acc, da[:, lo:hi])
        wrt = [q, k, v] + ([sinks] if sinks is not None and sinks.requires_grad else [])
        grads = torch.autograd.grad(a, wrt, da, allow_unused=True)
        del a, da
        # Without FPDT the attention's whole state is on the device until here: the next layer's
        # input comes in now, under the pre-attention backward, not on top of that state.
        self._prefetch()
        dq, dk, dv = grads[:3]
        if len(grads) > 3 and grads[3] is not None:
            acc.add(next(i for i, p in enumerate(self.params) if p is sinks), grads[3])
        for lo, hi in chunks:
            self._pre_backward(lo, hi, h, (dq[:, lo:hi], dk[:, lo:hi], dv[:, lo:hi]), dh, acc, replicate=False)
