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
    """memory="max": row-chunked layers (`integrations/layer_split.py`), phase by phase."""
    u, U = s.fpdt_chunks, s.ulysses
    h = dims.hidden
    c = S / u if u > 1 else S  # rows of an FPDT chunk
    pieces = max(1, math.ceil(n / u))
    p = c / pieces if u > 1 else r  # rows of a pre/post-attention piece
    mlp_fwd = 3 if dims.gated else 2  # I-wide tensors alive in a piece's forward without a graph
    k = min(L, s.inputs_on_device)  # the last k layers' checkpointed inputs stay on the device
    host = {"layer inputs (checkpointed)": (L - k) * pinned(1, z.v * S)} if offload else {}
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
                fpdt_kept_host(z, S, u) + fpdt_backward_host(z, S, u))
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
            Phase("layer backward: FPDT backward loop", held | seq | fpdt_loop(z, c) | kernel),
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


def _split_loss(z: Sizes, dims: ModelDims, S: float, lr: int) -> dict:
    return {"last layer output (final norm input)": z.v * S} | loss_terms(z, dims, S, lr, True)
