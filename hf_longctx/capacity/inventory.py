"""The op inventory of one training step of a Llama-style decoder, in closed form, per setting.

Where it sits: the fast side of the step-time model. `capacity/step_time.step_time` asks it
for the ops of one micro-batch on one GPU of a setting (`Shape`: the model's sizes, the
rows per rank, the documents, the mesh and the memory knobs as `patch()` resolves them) and
hands them to `capacity/roofline.py`. It mirrors the patched step op by op (`module_ops.py`
for HF's modules; the library's own attention, chunking, checkpointing and offload here) and
is checked against the stream a real patched step records (`benchmarks/_op_stream.py`) by
tests/unit/test_step_model.py, so a change in the hot path the inventory does not follow
fails there. FPDT §3-4, USP §3-4 (what runs where); the kernels' work: FlashAttention-2."""

from __future__ import annotations

from dataclasses import dataclass

from hf_longctx.capacity import module_ops as m
from hf_longctx.capacity.op_cost import (ATTN_BWD, ATTN_FWD, H2D, P2P, Op, attention_pairs, each, pcie, split, summed,
                                         times)


@dataclass(frozen=True)
class Shape:
    """What the op stream of one rank depends on. `rows`: tokens this rank holds; `docs`:
    document lengths of the SP group's sequence (one document of rows·sp by default);
    `mlp_chunks` / `loss_chunk`: the row chunks of the token-wise parts and the loss's chunk
    length as `patch()` resolves them for these rows (1 / rows: unchunked); `fused`:
    `patch(fused=True)`, each compiled region one kernel per pass (`module_ops.fused_*`)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rows: int
    docs: tuple = ()
    ulysses: int = 1
    ring: int = 1
    fpdt_chunks: int = 1
    checkpoint: bool | str = False
    kv_offload: bool = False
    mlp_chunks: int = 1
    loss_chunk: int = 0  # 0: unchunked loss (HF's)
    keep_attention: bool = False  # checkpoint=True: the attention's output and LSE kept for the backward
    fused: bool = False

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def documents(self) -> tuple:
        return self.docs or (self.rows * self.sp,)


def _kernels(pairs: float, rows: float, heads: float, q: float, kv: float, d: int, calls: int = 1) -> tuple[Op, Op]:
    """`calls` flash-attn calls, forward and backward, visiting `pairs` (query, key) pairs in
    all over `rows` query rows of `heads` heads (q / kv: their widths)."""
    io = m.BF * rows * (2 * q + 2 * kv)
    fwd = Op(ATTN_FWD, flops=4.0 * pairs * heads * d / calls, bytes=float(io + m.F32 * heads * rows) / calls,
             count=calls, what="flash_forward")
    bwd = Op(ATTN_BWD, flops=10.0 * pairs * heads * d / calls, bytes=float(2 * io + m.F32 * heads * rows) / calls,
             count=calls, what="flash_backward")
    return fwd, bwd


def attention_core(s: Shape) -> tuple[list[Op], list[Op]]:
    """The attention call of one layer between the projections, forward and backward.

    One GPU: one packed flash-attn call over every document (recorded-stream exact). With
    sequence parallelism (modelled from ops/ulysses.py, ring.py, fpdt.py; not yet pinned to a
    recorded stream op by op): Ulysses all-to-alls of q, k, v (K/V replicated to `ulysses`
    heads where needed) and of the output, each with its send and receive copies; the zigzag
    ring's R kernel calls per pass, K/V blocks sent R-1 times forward and dK/dV (fp32) R times
    backward, each block's partial result merged into fp32 sums; FPDT's u(u+1)/2 chunk-pair
    calls and per-chunk all-to-alls."""
    pairs = sum(attention_pairs(n, n, True) for n in s.documents())
    if s.sp == 1 and s.fpdt_chunks == 1:
        fwd, bwd = _kernels(pairs, s.rows, s.heads, s.q, s.kv, s.head_dim)
        return [fwd], [bwd]
    from hf_longctx.ops.ulysses import kv_replication
    from hf_longctx.capacity.op_cost import COLLECTIVE

    u, r, chunks = s.ulysses, s.ring, s.fpdt_chunks
    kv = s.kv * kv_replication(s.heads, s.kv_heads, u)
    n, heads = s.rows * u, s.heads // u  # rows of this rank's ring stream, its heads
    q_w, kv_w = s.q // u, kv // u
    calls = r if chunks == 1 else chunks * (chunks + 1) // 2
    fwd_k, bwd_k = _kernels(pairs / (u * r) * u, n, heads, q_w, kv_w, s.head_dim, calls)  # per head group

    def a2a(width: float, times: int = 1) -> list[Op]:
        b = m.BF * s.rows * width
        wire = b * (u - 1) / u
        return [Op(COLLECTIVE, bytes=2 * b / times, link="ulysses", wire=wire / times, count=times, what="all_to_all"),
                *m.copy(s.rows * width), *m.copy(s.rows * width)] if u > 1 else []

    per = max(1, chunks)
    fwd = [*a2a(s.q + 2 * kv, per), fwd_k, *a2a(s.q, per)]
    bwd = [*a2a(s.q, per), bwd_k, *a2a(s.q + 2 * kv, per)]
    merges = (r - 1) if chunks == 1 else chunks * (chunks - 1) // 2
    if merges:
        acc = n * q_w / max(1, calls // max(1, merges))
        fwd += times(m.ew(10 * acc, what="merge"), merges)  # fp32 out += block (in place), LSE
        bwd += times(m.ew(12 * acc, what="grad sums"), merges)  # fp32 dq / dkv accumulators
    if r > 1:
        block = 2 * m.BF * n * kv_w  # packed K/V of one ring stream
        fwd += [Op(P2P, bytes=block, link="ring", wire=block, count=r - 1, what="send")]
        bwd += [Op(P2P, bytes=block, link="ring", wire=block, count=r - 1, what="send"),
                Op(P2P, bytes=2 * block, link="ring", wire=2 * block, count=r, what="send")]
    if chunks > 1 and s.kv_offload:  # finished chunks to host and back (FPDT §3.4; side streams)
        b = m.BF * s.rows * (3 * s.q + 2 * s.kv) * (1 + chunks) / 2
        fwd += [pcie("d2h", b / chunks, "kv offload").times(chunks)]
        bwd = [pcie("h2d", b / chunks, "kv offload").times(chunks)] + bwd  # each chunk fetched ahead of its kernels
    return fwd, bwd


def _norm_f(s: Shape, n: int) -> list[Op]:
    return m.norm_fwd(n, s.hidden, s.fused)


def _norm_b(s: Shape, n: int) -> list[Op]:
    return m.norm_bwd(n, s.hidden, s.fused)


def _rope_f(s: Shape, n: int) -> list[Op]:
    return m.rope_pair(n, s.heads, s.kv_heads, s.head_dim, fused=s.fused)


def _rope_b(s: Shape, n: int) -> list[Op]:
    return m.rope_pair(n, s.heads, s.kv_heads, s.head_dim, backward=True, fused=s.fused)


def norm_forward(s: Shape, n: int) -> list[Op]:
    """A decoder norm: whole, or over row chunks (`ops/tiling.tokenwise_chunks`) and concatenated."""
    if s.mlp_chunks == 1:
        return _norm_f(s, n)
    return each(split(n, s.mlp_chunks), lambda c: _norm_f(s, c)) + m.copy(n * s.hidden, what="cat")


def norm_backward(s: Shape, n: int) -> list[Op]:
    """`_Tokenwise.backward`: per chunk recompute + backward, its rows copied into one input
    gradient, the weight's chunk gradients summed in fp32 and rounded once."""
    h = s.hidden
    if s.mlp_chunks == 1:
        return _norm_b(s, n)
    chunks = split(n, s.mlp_chunks)
    ops = each(chunks, lambda c: _norm_f(s, c) + _norm_b(s, c) + m.copy(c * h, what="copy_"))
    return ops + m.copy(h, m.BF, m.F32) + times(m.ew(10 * h, what="add_"), len(chunks) - 1) + m.copy(h, m.F32, m.BF)


def mlp_forward(s: Shape, n: int) -> list[Op]:
    if s.mlp_chunks == 1:
        return m.mlp_fwd(n, s.hidden, s.intermediate, s.fused)
    chunks = split(n, s.mlp_chunks)
    return each(chunks, lambda c: m.mlp_fwd(c, s.hidden, s.intermediate, s.fused)) + m.copy(n * s.hidden, what="cat")


def mlp_backward(s: Shape, n: int) -> list[Op]:
    """`ops/tiling._Tokenwise` over the MLP: per chunk the whole MLP again, then the chunk's
    backward, its weight gradients written into one fp32 sum each (`wgrad`) and its rows of
    the input gradient copied into one buffer; the three sums rounded once."""
    h, i, f = s.hidden, s.intermediate, s.fused
    if s.mlp_chunks == 1:
        return m.mlp_bwd(n, h, i, fused=f)
    ops = summed(split(n, s.mlp_chunks), lambda c, fresh: [*m.mlp_fwd(c, h, i, f), *m.mlp_bwd(c, h, i, fresh, f),
                                                           *m.copy(c * h, what="copy_")])
    return ops + times(m.copy(h * i, m.F32, m.BF), 3)


def layer_forward(s: Shape, n: int, attn: list[Op]) -> list[Op]:
    """One decoder layer's forward on n rows with `attn` as its attention core."""
    h = s.hidden
    return [*norm_forward(s, n), *m.attention_proj_fwd(n, h, s.q, s.kv), *_rope_f(s, n), *attn,
            *m.linear_fwd(n, s.q, h), *m.add(n * h), *norm_forward(s, n), *mlp_forward(s, n), *m.add(n * h)]


def layer_backward(s: Shape, n: int, attn: list[Op]) -> list[Op]:
    h = s.hidden
    return [*mlp_backward(s, n), *norm_backward(s, n), *m.add(n * h), *m.linear_bwd(n, s.q, h), *attn, *_rope_b(s, n),
            *m.attention_proj_bwd(n, h, s.q, s.kv), *norm_backward(s, n), *m.add(n * h)]


def kept_attention(s: Shape, n: int) -> list[float]:
    """Bytes checkpoint="attention" keeps per layer (`integrations/checkpoint_attention.py`): the
    kernel's saved q, k, v, output and fp32 LSE, and the output the recompute replays."""
    return [m.BF * n * s.q, m.BF * n * s.kv, m.BF * n * s.kv, m.BF * n * s.q, m.F32 * n * s.heads, m.BF * n * s.q]


def keep_attention_layer(s: Shape, n: int, fwd: list[Op], bwd: list[Op]) -> list[Op]:
    """checkpoint="attention": input and kept tensors to host in the forward, back before the
    recompute, which stops (non-reentrant early stop) once the chunked MLP's node has saved
    its input, after its forward: only the last residual add does not rerun."""
    h = s.hidden
    kept = kept_attention(s, n)
    recompute = [*norm_forward(s, n), *m.attention_proj_fwd(n, h, s.q, s.kv), *_rope_f(s, n),
                 *m.linear_fwd(n, s.q, h), *m.add(n * h), *norm_forward(s, n), *mlp_forward(s, n)]
    return ([pcie("d2h", m.BF * n * h)] + layer_forward(s, n, [*fwd, *[pcie("d2h", b) for b in kept]])
            + [pcie("h2d", m.BF * n * h), *[pcie("h2d", b) for b in kept]] + recompute + layer_backward(s, n, bwd))


def _bounds(lo: int, hi: int, pieces: int) -> list[int]:
    """Row counts of `integrations/layer_run._bounds`."""
    if hi <= lo:
        return []
    step = -(-(hi - lo) // max(1, pieces))
    return [min(a + step, hi) - a for a in range(lo, hi, step)]


def _pre(s: Shape, c: int) -> list[Op]:
    """LayerSplit.pre: the layer up to its attention call on c rows."""
    return [*_norm_f(s, c), *m.attention_proj_fwd(c, s.hidden, s.q, s.kv), *_rope_f(s, c)]


def _pre_for_backward(s: Shape, c: int) -> list[Op]:
    """pre on c rows in its own backward: no q, k, v GEMM (`integrations/unread_outputs.py`)."""
    return [*_norm_f(s, c), *_rope_f(s, c)]


def _post(s: Shape, c: int) -> list[Op]:
    """LayerSplit.post: the layer on c rows with the attention replayed; the input norm, the
    q, k, v projections and RoPE (no gradient path to the output there) are not run
    (`LayerSplit.before_attention`, `LayerSplit.rope`)."""
    h = s.hidden
    return [*m.linear_fwd(c, s.q, h), *m.add(c * h), *_norm_f(s, c),
            *m.mlp_fwd(c, h, s.intermediate, s.fused), *m.add(c * h)]


def _qkv_full(s: Shape, n: int) -> list[Op]:
    """`LayerRun._qkv_full`: pre on every row chunk, each copied into the full q, k, v."""
    return each(_bounds(0, n, s.mlp_chunks), lambda c: _pre(s, c) + m.copy(c * s.q) + m.copy(c * s.kv) + m.copy(c * s.kv))


def _rope_tangents(s: Shape, c: int) -> list[Op]:
    """Fused: the compiled RoPE's backward takes its gradients in its outputs' layout [B, h, rows,
    D], where a row chunk's dq and dk are views of [B, rows, h, D]: one copy each."""
    return [*m.copy(c * s.q), *m.copy(c * s.kv)] if s.fused else []


def _norm_sum(h: int, fresh: bool) -> list[Op]:
    """A norm weight's chunk gradient into its fp32 sum (`GradSums.add`: widened, then added)."""
    return m.copy(h, m.BF, m.F32) if fresh else m.ew(10 * h, what="add_")


def split_layer(s: Shape, n: int, fwd: list[Op], bwd: list[Op]) -> list[Op]:
    """memory="max" without FPDT chunks (`integrations/layer_run.py`): row-chunked forward
    and backward of the layer around one attention call, its input on the host; each
    projection's weight gradient written into its fp32 sum per chunk (`wgrad`), the norm
    weights' summed, every sum rounded once at the end. `keep_attention`: the attention's
    output and fp32 LSE go to the host with the input; the backward replays them (the
    all-to-alls and chunk bookkeeping of `fwd` run again, no kernel, no ring pass, no merge)."""
    h, q, kv, i = s.hidden, s.q, s.kv, s.intermediate
    chunks = _bounds(0, n, s.mlp_chunks)
    kept = [m.BF * n * q, m.F32 * n * s.heads] if s.keep_attention else []
    replay = [op for op in fwd if op.kind not in (ATTN_FWD, P2P) and op.what != "merge"] if kept else fwd
    # The next layer's input (and kept tensors) is fetched where `LayerRun` asks for it: at the
    # start of the backward under FPDT, else after the attention backward (the roofline hides a
    # fetch under the compute after it).
    fetch = [pcie("h2d", m.BF * n * h), *[pcie("h2d", b) for b in kept]]
    early = s.fpdt_chunks > 1
    ops = [pcie("d2h", m.BF * n * h), *_qkv_full(s, n), *fwd, *[pcie("d2h", b) for b in kept]]
    ops += each(chunks, lambda c: _post(s, c) + m.copy(c * h, what="copy_"))
    ops += [*(fetch if early else []), *_qkv_full(s, n), *replay]
    ops += summed(chunks, lambda c, fresh: [
        *_post(s, c), *m.mlp_bwd(c, h, i, fresh, s.fused), *_norm_b(s, c), *m.add(c * h),
        *m.linear_bwd(c, q, h, fresh), *m.copy(c * h, what="copy_"), *_norm_sum(h, fresh), *m.copy(c * q, what="copy_")])
    ops += bwd + ([] if early else fetch)
    ops += summed(chunks, lambda c, fresh: [
        *_pre_for_backward(s, c), *_rope_tangents(s, c), *_rope_b(s, c), *m.attention_proj_bwd(c, h, q, kv, fresh),
        *_norm_b(s, c), *m.add(c * h), *_norm_sum(h, fresh)])  # `dh[:, rows].add_(g)`: in place on the row view
    params = [h * q, h * kv, h * kv, q * h, h * i, h * i, h * i, h, h]  # the sums, rounded to bf16
    return ops + [op for e in params for op in m.copy(e, m.F32, m.BF)]


def layer_ops(s: Shape) -> list[Op]:
    """Every op one decoder layer runs on this rank in one forward + backward."""
    fwd, bwd = attention_core(s)
    if s.checkpoint == "attention":
        return keep_attention_layer(s, s.rows, fwd, bwd)
    if s.checkpoint is True:
        return split_layer(s, s.rows, fwd, bwd)
    return layer_forward(s, s.rows, fwd) + layer_backward(s, s.rows, bwd)


def loss_ops(s: Shape, n: int) -> list[Op]:
    """LM head + loss: HF's over all rows, or `ops/chunked_loss.py`'s chunks (every gradient
    taken in the forward, the head's weight gradient written into its fp32 sum by each
    chunk's GEMM), then its backward's scaling. `fused`: HF's loss compiled (`module_ops.
    fused_loss`), or per chunk the fused tail (`ops/chunked_loss._fused_chunks`: the logits'
    gradient from one kernel, then the two gradient GEMMs; 1 / the denominator once)."""
    h, v = s.hidden, s.vocab
    if not s.loss_chunk:
        return [*m.linear_fwd(n, h, v), *(m.fused_loss(n, v) if s.fused else m.loss_fwd_bwd(n, v)),
                *m.linear_bwd(n, h, v)]
    ops = m.ew(m.F32, *([2 * m.F32] if s.fused else []), what="zeros")
    sizes = [min(s.loss_chunk, n - lo) for lo in range(0, n, s.loss_chunk)]
    tail = m.cross_entropy_tail if s.fused else m.loss_fwd_bwd
    ops += summed(sizes, lambda c, fresh: [*m.linear_fwd(c, h, v), *tail(c, v), *m.linear_bwd(c, h, v, fresh),
                                           *m.ew(3 * m.F32, what="add_"), *m.copy(c * h, what="copy_")])
    return ops + m.ew(2 * m.F32, 2 * m.F32, m.F32 + m.BF, 2 * m.BF * n * h + m.BF, 2 * m.F32 * v * h + m.F32,
                      what="loss") + m.copy(v * h, m.F32, m.BF)


def step_ops(s: Shape) -> list[Op]:
    """What the step runs outside its decoder layers: embedding, rotary tables, final norm,
    LM head and loss, the kernels' cumulative lengths."""
    n, h = s.rows, s.hidden
    cu = Op(H2D, bytes=4.0 * (len(s.documents()) + 1), link="pcie", wire=4.0 * (len(s.documents()) + 1), what="h2d")
    return [*m.embedding(n, h, s.vocab), *m.rope_tables(n, s.head_dim), cu, cu, *norm_forward(s, n),
            *loss_ops(s, n), *norm_backward(s, n)]


def step_inventory(s: Shape, layers: int) -> list[Op]:
    return step_ops(s) + [op for _ in range(layers) for op in layer_ops(s)]
