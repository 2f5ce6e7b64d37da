"""The per-token memory budget of memory="max": decoder layers run in row chunks split at their
attention call (`integrations/layer_split.py`), phase by phase.

Where it sits: `capacity/budget.step_budget` hands it the settings with checkpoint=True and MLP
chunks. Layer inputs are kept (on the host when offloading, the last `inputs_on_device` on the
device); a layer's forward holds one pre/post-attention piece and the attention of an FPDT chunk
or of the whole sequence; its backward recomputes and consumes the attention chunk by chunk
(FPDT) or whole (Ulysses / ring), pieces around it. Each term is a tensor of the census
(`benchmarks/memory_budget.py`; held within 5 % by tests/unit/test_memory_budget.py). FPDT §3-4."""

from __future__ import annotations

import math

from hf_longctx.capacity.budget_terms import (
    Budget,
    Phase,
    Sizes,
    fpdt_backward_host,
    fpdt_kept_host,
    fpdt_loop,
    loss_terms,
    pinned,
)
from hf_longctx.data.model_dims import ModelDims


def split_budget(dims, s, z: Sizes, S, n, r, lr, L, rope, kernel, offload) -> Budget:
    """memory="max": row-chunked layers (`integrations/layer_split.py`), phase by phase. Every phase
    holds what the step keeps (`held`); a layer's backward phases also its input, its gradient
    and its parameter-gradient sums (`seq`), and with FPDT on the device its attention state."""
    u = s.fpdt_chunks
    c = S / u if u > 1 else S  # rows of an FPDT chunk
    pieces = max(1, math.ceil(n / u))
    p = c / pieces if u > 1 else r  # rows of a pre/post-attention piece
    host, held = _kept_inputs(s, z, S, L, rope, offload)
    seq = {"layer input (device copy)": z.v * S if offload else 0.0, "gradient through the layer (in place)": z.v * S,
           "fp32 sums of the layer's parameter gradients": 4 * dims.layer_params}
    prefetch = {"next layer input (prefetched)": z.v * S} if offload and L > 1 else {}
    if s.keep_attention:
        _keep_attention(z, S, L, u, offload, host, held, seq, prefetch)
    forward, post = _piece_terms(dims, z, S, p)
    if u > 1:  # FPDT: prefetched when the layer's backward starts; without FPDT after its attention's backward
        on_device, on_host = _fpdt_state(s, z, S, u, offload)
        seq |= prefetch | on_device
        host |= on_host
        attention, backward = _fpdt_phases(dims, s, z, c, p, post, kernel)
    else:
        attention, backward = _sequence_phases(dims, s, z, S, n, r, post, prefetch, kernel)
    phases = (Phase("forward", held | forward | attention), Phase("loss", held | _split_loss(z, dims, S, lr)),
              *(Phase(name, held | seq | terms) for name, terms in backward.items()))
    return Budget(phases, host, float(sum(held.values())))


def _kept_inputs(s, z: Sizes, S, L, rope, offload) -> tuple[dict, dict]:
    """(host, held): every layer's checkpointed input, pinned on the host when offloading except
    the last `inputs_on_device` layers' (held on the device), else all on the device; the
    rotary tables held."""
    k = min(L, s.inputs_on_device)  # the last k layers' checkpointed inputs stay on the device
    host = {"layer inputs (checkpointed)": (L - k) * pinned(1, z.v * S)} if offload else {}
    held = dict(rope)
    if not offload:
        held["layer inputs (checkpointed)"] = L * z.v * S
    elif k:
        held["layer inputs kept on the device (inputs_on_device)"] = k * z.v * S
    return host, held


def _keep_attention(z: Sizes, S, L, u, offload, host, held, seq, prefetch) -> None:
    """keep_attention: every layer's attention output (kernel layout) and fp32 LSE, pinned on
    the host when offloading (per FPDT chunk with FPDT) else on the device; the layer in backward
    reads its own back (without FPDT in place of the recomputed output the phases count already)
    and the next one's comes in with that layer's input."""
    kept = (z.qb + z.lse) * S
    if not offload:
        held["attention output and lse kept (keep_attention)"] = L * kept
        return
    host["attention output and lse kept (keep_attention)"] = L * pinned(u, z.qb * S / u) + L * pinned(u, z.lse * S / u)
    if u > 1:  # FPDT: the chunks' copies through the layer's backward (without FPDT they replace the recompute's)
        seq["kept attention output and lse (device copy)"] = kept
    if prefetch:
        prefetch["next layer's kept attention output and lse (prefetched)"] = kept


def _piece_terms(dims, z: Sizes, S, p) -> tuple[dict, dict]:
    """(forward, post) for pieces of `p` rows: what a layer's forward holds beside its attention
    (a post-attention piece runs without a graph), and a post-attention piece's backward."""
    mlp_fwd = 3 if dims.gated else 2  # I-wide tensors alive in a piece's forward without a graph
    forward = {"embedding output (held by the model's forward)": z.v * S, "layer input": z.v * S,
               "layer output": z.v * S, "post-attention piece, forward": p * (mlp_fwd * z.ib + 2 * z.v)}
    post = {"post-attention piece: MLP tensors and gradients, norm (fp32), residual":
            p * (z.mlp_saved + 2 * z.ib + 8 * dims.hidden + 2 * z.v)}
    return forward, post


def _fpdt_state(s, z: Sizes, S, u, offload) -> tuple[dict, dict]:
    """(device, host): the attention state of the layer in backward (q, k, v, lse, dout and out
    chunks, the fp32 dq sums): pinned on the host with K/V offload, else on the device."""
    if s.kv_offload and offload:
        return {}, {"attention state of the layer in backward (q, k, v, lse, dout, out, dq sums)":
                    fpdt_kept_host(z, S, u) + fpdt_backward_host(z, S, u)}
    store = {"q chunks": z.qb * S, "K/V chunks": 2 * z.kvb * S, "lse chunks": z.lse * S,
             "dout and out chunks": 2 * z.qb * S, "dq sums (fp32)": 2 * z.qb * S * (u - 1) / u}
    return {f"attention state (on device): {k}": b for k, b in store.items()}, {}


def _fpdt_phases(dims, s, z: Sizes, c, p, post, kernel) -> tuple[dict, dict]:
    """With FPDT (chunks of `c` rows): (the forward's attention terms, the backward's phases:
    name -> terms beside `held` and `seq`)."""
    h = dims.hidden
    out_tok = c * z.qb if s.ulysses > 1 else 0.0  # the output chunk back in the token layout (a view when U = 1)
    attention = {"FPDT chunk: q, k, v, output, lse": c * (2 * z.qb + 2 * z.kvb + z.lse) + out_tok}
    return attention, {
        "layer backward: recompute, pre-attention of a chunk": {
            "pre-attention of a chunk (fp32 norm copy, q, k, v, rotary)": c * (4 * h + 3 * z.qb + 3 * z.kvb)},
        "layer backward: recompute, attention of a chunk": {
            "FPDT chunk: q, k, v": c * (z.qb + 2 * z.kvb), "streamed K/V chunks (two)": 2 * c * 2 * z.kvb,
            "output sums and chunk result (fp32), lse": c * (4 * z.qb + z.lse)} | kernel,
        "layer backward: post-attention backward": {
            "FPDT chunk: q, k, v, output, its gradient, lse": c * (3 * z.qb + 2 * z.kvb + z.lse) + out_tok} | post,
        "layer backward: FPDT backward loop": fpdt_loop(z, c) | kernel,
        "layer backward: pre-attention backward": {
            "next K/V chunk": c * 2 * z.kvb, "dq, dk, dv of the chunk's rows": c * (z.qb + 2 * z.kvb),
            "pre-attention piece: norm (fp32) and q, k, v gradients": p * (24 * h + z.qb + 2 * z.kvb)},
    }


def _sequence_phases(dims, s, z: Sizes, S, n, r, post, prefetch, kernel) -> tuple[dict, dict]:
    """Without FPDT (the attention over the whole local sequence: Ulysses and / or ring): (the
    forward's attention terms, the backward's phases: name -> terms beside `held` and `seq`)."""
    qkv = {"q, k, v of every row": (z.qb + 2 * z.kvb) * S,
           "attention output and lse (kernel layout), output (token layout)":
               (z.qb + z.lse + (z.qb if s.sp > 1 else 0.0)) * S}
    # Ulysses: the recompute's q, k, v also exist in the kernel's head layout (the
    # all-to-all's receive buffer) until the kernel's backward; its dq, dk, dv go back
    # through a send and a receive buffer before dq reaches the token layout.
    heads = {"q, k, v (head layout, received)": (z.qb + 2 * z.kvb) * S} if s.ulysses > 1 else {}
    backward = {
        # one piece only (a short sequence): its peak comes before any parameter-gradient sum exists
        "layer backward: post-attention backward": qkv | heads | {"attention output gradient": z.qb * S} | post | (
            {} if n > 1 else {"fp32 sums of the layer's parameter gradients": 0.0}),
        "layer backward: attention backward": qkv | heads | {
            "attention output gradient (token and kernel layout)": 2 * z.qb * S,
            "dq, dk, dv": (z.qb + 2 * z.kvb) * S} | _ring_buffers(s, z, S) | kernel,
    }
    if s.ulysses > 1:
        backward["layer backward: the gradients' all-to-all"] = {
            "q, k, v of every row": (z.qb + 2 * z.kvb) * S, "output and its gradient (token layout)": 2 * z.qb * S,
            # the head-layout gradients (held by the engine) with the send and receive buffers,
            # then with the receive buffer and the token-layout copies (the send buffer freed)
            "dq, dk, dv: head layout, send buffer, receive buffer": 3 * (z.qb + 2 * z.kvb) * S}
    backward["layer backward: pre-attention backward"] = prefetch | {
        "dq, dk, dv": (z.qb + 2 * z.kvb) * S,
        "pre-attention piece: norm (fp32) and q, k, v gradients": r * (24 * dims.hidden + z.qb + 2 * z.kvb)}
    return qkv, backward


def _ring_buffers(s, z: Sizes, S) -> dict:
    """Ring: K/V packed to send, K/V and their fp32 gradient sums in flight (send and receive
    buffers), and one ring step's dq, dk, dv as the CPU census measures them (fp32 over the
    query heads; flash-attn returns them in bf16 over the KV heads: an upper bound there). Per
    token as the census measures them at R = 2 (one remote step: no next block in flight while
    it runs) and R = 4; larger rings are budgeted as R = 4 (each step holds the same buffers),
    not measured. Nothing without a ring."""
    if s.ring <= 1:
        return {}
    steps = 2 if s.ring == 2 else 3
    return {"K/V packed for the ring": 2 * z.kvb * S,
            "K/V and their fp32 gradient sums in flight (send, receive)": (2 + 2 * steps) * z.kvb * S,
            "a ring step's dq, dk, dv (fp32, query heads)": 2 * steps * z.qb * S}


def _split_loss(z: Sizes, dims: ModelDims, S: float, lr: int) -> dict:
    return {"last layer output (final norm input)": z.v * S} | loss_terms(z, dims, S, lr, True)
