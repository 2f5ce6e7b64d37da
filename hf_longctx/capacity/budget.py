"""The per-token memory budget of one training step: every tensor the step keeps or makes, by
name, per phase, on the device and on the host (what `capacity/estimate.py` builds on).

Where it sits: outside the training data flow, under `hf-longctx plan`. Each term is a named
tensor of the census `benchmarks/memory_budget.py` takes of a real step, its bytes written
from the model's sizes (not fitted); tests/unit/test_memory_budget.py holds the sum within
5 % of the census for the presets. Phases: forward, loss, a layer's backward; the device
peak is the largest. Presets (FPDT §3-4): "off"/"balanced" keep every layer's activations,
"high" the attention's saved tensors and layer inputs, "max" only the layer inputs (host)
with row-chunked layers. The kernel's own workspace (`kernel`) is a term apart.
Symbols (`_Sizes`: v, qb, kvb, ib, lse) and method: docs/DESIGN.md "The per-token memory budget"."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hf_longctx.data.model_dims import ModelDims
from hf_longctx.ops.host_pool import size_class
from hf_longctx.ops.tiling import MIN_LOSS_CHUNK_TOKENS, mlp_chunks_at
from hf_longctx.ops.ulysses import kv_replication

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Phase:
    name: str
    terms: dict  # term name -> bytes

    @property
    def total(self) -> float:
        return float(sum(self.terms.values()))


@dataclass(frozen=True)
class Budget:
    """Device bytes above the weights per phase, host bytes at their peak, and what is held
    across the whole step (`held`, part of every phase)."""

    phases: tuple
    host_terms: dict = field(default_factory=dict)
    held: float = 0.0

    @property
    def device(self) -> float:
        return max(p.total for p in self.phases)

    @property
    def binding(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def host(self) -> float:
        return float(sum(self.host_terms.values()))

    @property
    def kernel(self) -> float:
        """The binding phase's local-kernel workspace (counted apart by the CPU census)."""
        return self.binding.terms.get("attention kernel workspace (fp32 dq accumulator)", 0.0)


@dataclass(frozen=True)
class _Sizes:
    dt: int
    v: float
    qb: float
    kvb: float
    ib: float
    lse: float
    rope: float
    mlp_saved: float  # I-wide tensors an unchunked MLP saves (gated: gate, up, act, product)

    @classmethod
    def of(cls, dims: ModelDims, dt: int, f: int) -> "_Sizes":
        q, kv = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim * f
        return cls(dt, dt * dims.hidden, dt * q, dt * kv, dt * dims.intermediate, 4 * dims.heads,
                   2 * dt * dims.head_dim, (4 if dims.gated else 2) * dt * dims.intermediate)


def token_chunks(dims: ModelDims, mlp_chunks: int, s_local: int) -> int:
    """Row chunks of the token-wise parts (MLP, norms, a row-chunked layer's pieces) for a
    setting's MLP chunks (1: none; else the "auto" count, at least MIN_MLP_CHUNK_TOKENS rows)."""
    return 1 if mlp_chunks <= 1 else mlp_chunks_at(mlp_chunks, s_local, auto=True)


def loss_rows(dims: ModelDims, s_local: int, loss_chunks: int) -> int:
    """Tokens per LM-head chunk: `loss_chunks` = 0 means the default (`ops/tiling`), 1 unchunked."""
    if loss_chunks == 0:
        n = max(1, math.ceil(8 * dims.vocab / dims.hidden))
        return min(s_local, max(math.ceil(s_local / n), MIN_LOSS_CHUNK_TOKENS))
    return -(-s_local // loss_chunks)


def _pinned(count: float, nbytes: float) -> float:
    """`count` pinned host buffers of `nbytes` each, as the pool allocates them (size classes)."""
    return count * size_class(int(math.ceil(nbytes)))


def _fpdt_kept_host(z: _Sizes, S: float, u: int) -> float:
    """FPDT's offloaded chunks of one layer kept for its backward: q, k, v, lse per chunk."""
    c = S / u
    return _pinned(u, c * z.qb) + _pinned(2 * u, c * z.kvb) + _pinned(u, c * z.lse)


def _fpdt_backward_host(z: _Sizes, S: float, u: int) -> float:
    """What one layer's FPDT backward adds on the host: dout and out per chunk, dq sums (fp32)."""
    c = S / u
    return _pinned(2 * u, c * z.qb) + _pinned(u - 1, 2 * c * z.qb)


def _fpdt_loop(z: _Sizes, c: float) -> dict:
    """One step of FPDT's backward loop (K/V chunk outer, query chunks inner), chunk rows c."""
    return {"K/V chunk and the next one": 2 * c * 2 * z.kvb,
            "query chunks (this and the next): q, dout, out, lse, dq sum (fp32)": 2 * c * (5 * z.qb + z.lse),
            "kernel gradients and the K/V chunk's dK/dV sums (fp32)": c * (2 * z.qb + 2 * 4 * z.kvb),
            "finished dq of the outer chunk (fp32)": c * 2 * z.qb}


def _mlp_chunk(z: _Sizes, dims: ModelDims, rows: float) -> dict:
    """One token-wise chunk's backward: the MLP recomputed (its I-wide tensors and their
    gradients) and the norm before it (fp32 copies)."""
    h = dims.hidden
    return {"MLP chunk recompute (I-wide tensors and gradients)": rows * (z.mlp_saved + 2 * z.ib),
            "norm chunk (fp32 copy, normalized, output)": rows * (4 * h + 2 * z.v)}


def _loss(z: _Sizes, dims: ModelDims, s: float, lr: int, chunked: bool) -> dict:
    v_, h = dims.vocab, dims.hidden
    if not chunked:
        return {"logits: log-softmax and two gradients (fp32)": 12 * v_ * s}
    # a chunk's log-softmax and its two gradients (fp32; the fp32 logits are freed before the
    # chunk's backward), its weight gradient (compute dtype) and the fp32 weight-gradient sum
    chunk = 12 * lr * v_ + (4 + z.dt) * v_ * h
    return {"final norm output (LM head input)": z.v * s, "gradient of the LM head input": z.v * s,
            "loss chunk (fp32 logits, log-softmax, gradients) and LM-head weight gradients": chunk}


def step_budget(dims: ModelDims, s, *, tokens: int, dtype: str = "bf16", offload: bool = True) -> Budget:
    """The budget of one forward + backward on one GPU for setting `s` (`capacity/estimate.Setting`)
    and `tokens` per SP group. `offload`: the device copies offloads to pinned host memory (CUDA);
    False: what would go to the host stays on the device."""
    dt = DTYPE_BYTES[dtype]
    f = kv_replication(dims.heads, dims.kv_heads, s.ulysses)
    z = _Sizes.of(dims, dt, f)
    S = tokens / s.sp
    n = token_chunks(dims, s.mlp_chunks, int(S))
    r = S / n
    lr = loss_rows(dims, int(S), s.loss_chunks)
    chunked = s.mlp_chunks > 1
    L = dims.layers
    k = min(L, s.inputs_on_device)  # the last k layers' checkpointed inputs stay on the device
    rope = {"rotary cos/sin": z.rope * S}
    # q, k, v, the kernel's out and lse, and the token-layout output: a new tensor after the
    # all-to-all or the ring's merge (SP > 1), the kernel's own output seen token-major on one GPU
    # FPDT saves its token-layout output only (its chunks' kernel outputs are transient).
    out_tok = z.qb if s.sp > 1 and s.fpdt_chunks <= 1 else 0.0
    att_saved = 2 * z.qb + 2 * z.kvb + z.lse + out_tok
    kernel = {"attention kernel workspace (fp32 dq accumulator)": 2 * z.qb * (S / s.fpdt_chunks if s.fpdt_chunks > 1 else S)}
    host: dict = {}
    if s.checkpoint is True and chunked:
        return _split_budget(dims, s, z, S, n, r, lr, L, rope, kernel, offload)
    fpdt_host = s.fpdt_chunks > 1 and s.kv_offload and offload
    if s.checkpoint:  # inputs kept (host when offloading); "attention": its saved tensors too
        # FPDT with offload: its q, k, v, lse chunks are on the host already; the output is kept once.
        # Otherwise the saved tensors and the token-layout output (a view of the kernel's on one GPU,
        # copied apart then) for the replay. checkpoint=True without MLP chunks (whole-layer
        # offloaded checkpointing) keeps the layer inputs only.
        keeps = s.checkpoint == "attention"
        kept_dev = 0.0 if not keeps else z.qb if fpdt_host else 3 * z.qb + 2 * z.kvb + z.lse
        per_layer = {"layer input (checkpointed)": z.v * S, "attention's saved tensors (kept)": kept_dev * S}
        if offload:  # one pinned buffer per tensor
            kept_host = (0.0 if not keeps else _pinned(1, z.qb * S) if fpdt_host else
                         _pinned(3, z.qb * S) + _pinned(2, z.kvb * S) + _pinned(1, z.lse * S))
            host = {"layer inputs (checkpointed)": (L - k) * _pinned(1, z.v * S),
                    "attention's saved tensors (kept)": L * kept_host}
            if fpdt_host:
                host["FPDT q, k, v, lse chunks"] = L * _fpdt_kept_host(z, S, s.fpdt_chunks)
            held = {"layer inputs kept on the device (inputs_on_device)": k * z.v * S}
        else:
            held = {k: L * b for k, b in per_layer.items()}
        held |= rope
        seq_h = {"layer input (device copy)": z.v * S, "next layer input (prefetched)": z.v * S,
                 "kept attention tensors (device copies)": kept_dev * S if offload else 0.0,
                 "gradient through the layer": z.v * S}
        layer_phases = {
            "layer backward: recompute, pre-attention": seq_h | {
                "norm output, q, k, v, rotary temporaries (whole sequence)": (z.v + 4 * z.qb + 2 * z.kvb) * S},
            "layer backward: MLP chunk backward": seq_h | {
                "recomputed norm outputs and attention residual": 3 * z.v * S,
                "gradient of the MLP input (assembled from the chunks)": z.v * S,
                "MLP chunk: I-wide tensors and gradients": r * (z.mlp_saved + 2 * z.ib),
                # at the I-wide peak (the gradients of the up/gate outputs being formed) only the
                # down projection's weight gradient exists; the others come as those are consumed
                "MLP chunk: weight gradient (down projection)": dims.hidden * dims.intermediate * z.dt},
        }
        if fpdt_host:
            c = S / s.fpdt_chunks
            layer_phases["layer backward: FPDT backward loop"] = seq_h | {
                "recomputed norm output (q, k, v projections' input)": z.v * S,
                "attention output gradient": z.qb * S, "dq, dk, dv (token layout)": (z.qb + 2 * z.kvb) * S,
            } | _fpdt_loop(z, c) | kernel
            host["attention state of the layer in backward: dout and out chunks, dq sums (fp32)"] = (
                _fpdt_backward_host(z, S, s.fpdt_chunks))
        loss = held | {"last layer output (final norm input)": z.v * S} | _loss(z, dims, S, lr, s.loss_chunks != 1)
        phases = (Phase("loss", loss), *(Phase(name, held | terms) for name, terms in layer_phases.items()))
        return Budget(phases, host, float(sum(held.values())))
    else:
        norms = 4 * z.v if chunked else 2 * (4 * dims.hidden + 2 * z.v) + 8  # inputs + outputs, or fp32 copies
        att_dev = z.qb if fpdt_host else att_saved  # FPDT with offload: q, k, v, lse on the host
        per_layer = {"norm inputs and outputs" if chunked else "norms (fp32 copies, outputs)": norms * S,
                     "attention (q, k, v, out, lse, o_proj input)": att_dev * S,
                     # one chunk (a short sequence with "auto" chunks): the MLP runs unchunked
                     "MLP (I-wide tensors)": 0.0 if chunked and n > 1 else z.mlp_saved * S}
        held = {k: L * b for k, b in per_layer.items()} | rope
        held["last layer output (final norm input)" if chunked else "final norm (fp32 copy, output)"] = (
            z.v * S if chunked else (4 * dims.hidden + 2 * z.v + 4) * S)
        if fpdt_host:
            host = {"FPDT q, k, v, lse chunks": L * _fpdt_kept_host(z, S, s.fpdt_chunks)}
        layer_bw = {"gradient through the layer": 2 * z.v * S} | (_mlp_chunk(z, dims, r) if chunked else {
            "MLP gradients (I-wide)": 2 * z.ib * S}) | kernel
    held_total = float(sum(held.values()))
    phases = (
        Phase("loss", held | _loss(z, dims, S, lr, s.loss_chunks != 1)),
        Phase("layer backward", held | layer_bw),
    )
    return Budget(phases, host, held_total)


def _split_budget(dims, s, z: _Sizes, S, n, r, lr, L, rope, kernel, offload) -> Budget:
    """memory="max": row-chunked layers (`integrations/layer_split.py`), phase by phase."""
    u, U = s.fpdt_chunks, s.ulysses
    h = dims.hidden
    c = S / u if u > 1 else S  # rows of an FPDT chunk
    pieces = max(1, math.ceil(n / u))
    p = c / pieces if u > 1 else r  # rows of a pre/post-attention piece
    mlp_fwd = 3 if dims.gated else 2  # I-wide tensors alive in a piece's forward without a graph
    k = min(L, s.inputs_on_device)  # the last k layers' checkpointed inputs stay on the device
    host = {"layer inputs (checkpointed)": (L - k) * _pinned(1, z.v * S)} if offload else {}
    held = dict(rope)
    if not offload:
        held["layer inputs (checkpointed)"] = L * z.v * S
    elif k:
        held["layer inputs kept on the device (inputs_on_device)"] = k * z.v * S
    seq = {"layer input (device copy)": z.v * S, "gradient through the layer (in place)": z.v * S,
           "fp32 sums of the layer's parameter gradients": 4 * dims.layer_params}
    prefetch = {"next layer input (prefetched)": z.v * S} if offload and L > 1 else {}
    if u > 1:  # FPDT: prefetched when the layer's backward starts; without FPDT after its attention's backward
        seq |= prefetch
    forward = {"embedding output (held by the model's forward)": z.v * S, "layer input": z.v * S,
               "layer output": z.v * S, "post-attention piece, forward": p * (mlp_fwd * z.ib + 2 * z.v)}
    post = {"post-attention piece: MLP tensors and gradients, norm (fp32), residual":
            p * (z.mlp_saved + 2 * z.ib + 8 * h + 2 * z.v)}
    loss = Phase("loss", held | _split_loss(z, dims, S, lr))
    if u > 1:
        store = {"q chunks": z.qb * S, "K/V chunks": 2 * z.kvb * S, "lse chunks": z.lse * S,
                 "dout and out chunks": 2 * z.qb * S, "dq sums (fp32)": 2 * z.qb * S * (u - 1) / u}
        if s.kv_offload and offload:
            host["attention state of the layer in backward (q, k, v, lse, dout, out, dq sums)"] = (
                _fpdt_kept_host(z, S, u) + _fpdt_backward_host(z, S, u))
        else:
            seq |= {f"attention state (on device): {k}": b for k, b in store.items()}
        out_tok = c * z.qb if U > 1 else 0.0  # the output chunk back in the token layout (a view when U = 1)
        phases = (
            Phase("forward", held | forward | {"FPDT chunk: q, k, v, output, lse": c * (2 * z.qb + 2 * z.kvb + z.lse)
                                                + out_tok}),
            loss,
            Phase("layer backward: recompute, pre-attention of a chunk", held | seq | {
                "pre-attention of a chunk (fp32 norm copy, q, k, v, rotary)": c * (4 * h + 3 * z.qb + 3 * z.kvb)}),
            Phase("layer backward: recompute, attention of a chunk", held | seq | {
                "FPDT chunk: q, k, v": c * (z.qb + 2 * z.kvb), "streamed K/V chunks (two)": 2 * c * 2 * z.kvb,
                "output sums and chunk result (fp32), lse": c * (4 * z.qb + z.lse)} | kernel),
            Phase("layer backward: post-attention backward", held | seq | {
                "FPDT chunk: q, k, v, output, its gradient, lse": c * (3 * z.qb + 2 * z.kvb + z.lse) + out_tok} | post),
            Phase("layer backward: FPDT backward loop", held | seq | _fpdt_loop(z, c) | kernel),
            Phase("layer backward: pre-attention backward", held | seq | {
                "next K/V chunk": c * 2 * z.kvb, "dq, dk, dv of the chunk's rows": c * (z.qb + 2 * z.kvb),
                "pre-attention piece: norm (fp32) and q, k, v gradients": p * (24 * h + z.qb + 2 * z.kvb)}),
        )
    else:
        qkv = {"q, k, v of every row": (z.qb + 2 * z.kvb) * S,
               "attention output and lse (kernel layout), output (token layout)":
                   (z.qb + z.lse + (z.qb if s.sp > 1 else 0.0)) * S}
        # Ulysses: the recompute's q, k, v also exist in the kernel's head layout (the
        # all-to-all's receive buffer) until the kernel's backward; its dq, dk, dv go back
        # through a send and a receive buffer before dq reaches the token layout.
        heads = {"q, k, v (head layout, received)": (z.qb + 2 * z.kvb) * S} if U > 1 else {}
        # Ring: K/V packed to send, K/V and their fp32 gradient sums in flight (send and receive
        # buffers), and one ring step's dq, dk, dv as the CPU census measures them (fp32 over
        # the query heads; flash-attn returns them in bf16 over the KV heads: an upper bound
        # there). Per token as the census measures them at R = 2 (one remote step: no next
        # block in flight while it runs) and R = 4; larger rings are budgeted as R = 4 (each
        # step holds the same buffers), not measured.
        steps = 2 if s.ring == 2 else 3
        ring = {"K/V packed for the ring": 2 * z.kvb * S,
                "K/V and their fp32 gradient sums in flight (send, receive)": (2 + 2 * steps) * z.kvb * S,
                "a ring step's dq, dk, dv (fp32, query heads)": 2 * steps * z.qb * S} if s.ring > 1 else {}
        phases = (
            Phase("forward", held | forward | qkv),
            loss,
            # one piece only (a short sequence): its peak comes before any parameter-gradient sum exists
            Phase("layer backward: post-attention backward", held | seq | qkv | heads | {
                "attention output gradient": z.qb * S} | post | (
                {} if n > 1 else {"fp32 sums of the layer's parameter gradients": 0.0})),
            Phase("layer backward: attention backward", held | seq | qkv | heads | {
                "attention output gradient (token and kernel layout)": 2 * z.qb * S,
                "dq, dk, dv": (z.qb + 2 * z.kvb) * S} | ring | kernel),
            *((Phase("layer backward: the gradients' all-to-all", held | seq | {
                "q, k, v of every row": (z.qb + 2 * z.kvb) * S, "output and its gradient (token layout)": 2 * z.qb * S,
                # the head-layout gradients (held by the engine) with the send and receive buffers,
                # then with the receive buffer and the token-layout copies (the send buffer freed)
                "dq, dk, dv: head layout, send buffer, receive buffer": 3 * (z.qb + 2 * z.kvb) * S}),) if U > 1 else ()),
            Phase("layer backward: pre-attention backward", held | seq | prefetch | {
                "dq, dk, dv": (z.qb + 2 * z.kvb) * S,
                "pre-attention piece: norm (fp32) and q, k, v gradients": r * (24 * h + z.qb + 2 * z.kvb)}),
        )
    return Budget(phases, host, float(sum(held.values())))


def _split_loss(z: _Sizes, dims: ModelDims, S: float, lr: int) -> dict:
    return {"last layer output (final norm input)": z.v * S} | _loss(z, dims, S, lr, True)
