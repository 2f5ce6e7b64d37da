"""The per-token memory budget of one training step: every tensor the step keeps or makes, by
name, per phase, on the device and on the host (what `capacity/estimate.py` builds on).

Where it sits: outside the training data flow, under `hf-longctx plan`. Each term is a named
tensor of the census `benchmarks/memory_budget.py` takes of a real step, its bytes written
from the model's sizes (not fitted); tests/unit/test_memory_budget.py holds the sum within
5 % of the census for the presets. Phases: forward, loss, a layer's backward; the device
peak is the largest. Presets (FPDT §3-4): "off"/"balanced" keep every layer's activations,
"high" the attention's saved tensors and layer inputs (here), "max" only the layer inputs
with row-chunked layers (`capacity/layer_split_budget.py`). The kernel's own workspace
(`kernel`) is a term apart. Shared terms: `capacity/budget_terms.py`.
Symbols (`Sizes`: v, qb, kvb, ib, lse) and method: docs/DESIGN.md "The per-token memory budget"."""

from __future__ import annotations

from hf_longctx.capacity.budget_terms import (
    Budget,
    DTYPE_BYTES,
    KERNEL_TERM,
    Phase,
    Sizes,
    fpdt_backward_host,
    fpdt_kept_host,
    fpdt_loop,
    loss_rows,
    loss_terms,
    mlp_chunk,
    pinned,
    token_chunks,
)
from hf_longctx.capacity.layer_split_budget import split_budget
from hf_longctx.capacity.task_budget import with_task
from hf_longctx.data.model_dims import ModelDims
from hf_longctx.ops.ulysses import kv_replication


def step_budget(dims: ModelDims, s, *, tokens: int, dtype: str = "bf16", offload: bool = True,
                task: str = "sft") -> Budget:
    """The budget of one forward + backward on one GPU for setting `s` (`capacity/estimate.Setting`)
    and `tokens` per SP group. `offload`: the device copies offloads to pinned host memory (CUDA);
    False: what would go to the host stays on the device. `task`: "sft", or "dpo" / "grpo" /
    "rloo" (`capacity/task_budget.py`: the log-prob head, the objective's inputs, the reference)."""
    dt = DTYPE_BYTES[dtype]
    f = kv_replication(dims.heads, dims.kv_heads, s.ulysses)
    z = Sizes.of(dims, dt, f)
    S = tokens / s.sp
    n = token_chunks(dims, s.mlp_chunks, int(S))
    r = S / n
    lr = loss_rows(dims, int(S), s.loss_chunks, s.loss_chunk_rows)
    L = dims.layers
    rope = {"rotary cos/sin": z.rope * S}
    # flash-attn 2's varlen backward: dq accumulated in fp32 and softmax_d (fp32 per head); with
    # GQA (fewer K/V heads than query heads on the rank) dK/dV over the query heads, summed after
    kernel = {KERNEL_TERM: (4 * dims.heads * (dims.head_dim + 1) + (2 * z.qb if z.kvb < z.qb else 0.0))
              * (S / s.fpdt_chunks if s.fpdt_chunks > 1 else S)}
    if s.checkpoint is True and s.mlp_chunks > 1:
        build = split_budget
    else:
        build = _checkpointed_budget if s.checkpoint else _whole_layers_budget
    return with_task(build(dims, s, z, S, n, r, lr, L, rope, kernel, offload), task, dims, s, z, S, r, lr)


def _checkpointed_budget(dims, s, z: Sizes, S, n, r, lr, L, rope, kernel, offload) -> Budget:
    """checkpoint="attention" (the layer inputs and the attention's saved tensors kept) or
    checkpoint=True with the MLP unchunked (whole-layer offloaded checkpointing: the layer inputs
    only): what the step keeps (host when offloading), the loss, and one layer's backward."""
    k = min(L, s.inputs_on_device)  # the last k layers' checkpointed inputs stay on the device
    host: dict = {}
    fpdt_host = s.fpdt_chunks > 1 and s.kv_offload and offload
    # FPDT with offload: its q, k, v, lse chunks are on the host already; the output is kept once.
    # Otherwise the saved tensors and the token-layout output (a view of the kernel's on one GPU,
    # copied apart then) for the replay. checkpoint=True without MLP chunks (whole-layer
    # offloaded checkpointing) keeps the layer inputs only.
    keeps = s.checkpoint == "attention"
    kept_dev = 0.0 if not keeps else z.qb if fpdt_host else 3 * z.qb + 2 * z.kvb + z.lse
    per_layer = {"layer input (checkpointed)": z.v * S, "attention's saved tensors (kept)": kept_dev * S}
    if offload:  # one pinned buffer per tensor
        kept_host = (0.0 if not keeps else pinned(1, z.qb * S) if fpdt_host else
                     pinned(3, z.qb * S) + pinned(2, z.kvb * S) + pinned(1, z.lse * S))
        host = {"layer inputs (checkpointed)": (L - k) * pinned(1, z.v * S),
                "attention's saved tensors (kept)": L * kept_host}
        if fpdt_host:
            host["FPDT q, k, v, lse chunks"] = L * fpdt_kept_host(z, S, s.fpdt_chunks)
        held = {"layer inputs kept on the device (inputs_on_device)": k * z.v * S}
    else:
        held = {k: L * b for k, b in per_layer.items()}
    held |= rope
    # without offload the input is read in place: no device copy, nothing prefetched
    seq_h = {"layer input (device copy)": z.v * S if offload else 0.0,
             "next layer input (prefetched)": z.v * S if offload else 0.0,
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
        } | fpdt_loop(z, c) | kernel
        host["attention state of the layer in backward: dout and out chunks, dq sums (fp32)"] = (
            fpdt_backward_host(z, S, s.fpdt_chunks))
    loss = held | {"last layer output (final norm input)": z.v * S} | loss_terms(z, dims, S, lr, s.loss_chunks != 1)
    phases = (Phase("loss", loss), *(Phase(name, held | terms) for name, terms in layer_phases.items()))
    return Budget(phases, host, float(sum(held.values())))


def _whole_layers_budget(dims, s, z: Sizes, S, n, r, lr, L, rope, kernel, offload) -> Budget:
    """No checkpointing ("off", "balanced"): every layer's activations kept on the device (FPDT's
    q, k, v, lse chunks on the host with K/V offload), the loss, and one layer's backward."""
    chunked = s.mlp_chunks > 1
    host: dict = {}
    fpdt_host = s.fpdt_chunks > 1 and s.kv_offload and offload
    # q, k, v, the kernel's out and lse, and the token-layout output: a new tensor after the
    # all-to-all or the ring's merge (SP > 1), the kernel's own output seen token-major on one GPU
    # FPDT saves its token-layout output only (its chunks' kernel outputs are transient).
    out_tok = z.qb if s.sp > 1 and s.fpdt_chunks <= 1 else 0.0
    att_saved = 2 * z.qb + 2 * z.kvb + z.lse + out_tok
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
        host = {"FPDT q, k, v, lse chunks": L * fpdt_kept_host(z, S, s.fpdt_chunks)}
    layer_bw = {"gradient through the layer": 2 * z.v * S} | (mlp_chunk(z, dims, r) if chunked else {
        "MLP gradients (I-wide)": 2 * z.ib * S}) | kernel
    held_total = float(sum(held.values()))
    phases = (
        Phase("loss", held | loss_terms(z, dims, S, lr, s.loss_chunks != 1)),
        Phase("layer backward", held | layer_bw),
    )
    return Budget(phases, host, held_total)
