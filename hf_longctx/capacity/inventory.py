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
from hf_longctx.capacity.op_cost import ATTN_BWD, ATTN_FWD, H2D, Op, attention_pairs


@dataclass(frozen=True)
class Shape:
    """What the op stream of one rank depends on. `rows`: tokens this rank holds; `docs`:
    document lengths of the SP group's sequence (one document of rows·sp by default);
    `mlp_chunks` / `loss_chunk`: the row chunks of the token-wise parts and the loss's chunk
    length as `patch()` resolves them for these rows (1 / rows: unchunked)."""

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


def _attention_kernels(s: Shape, rows: int) -> tuple[Op, Op]:
    """The local flash-attn calls of one layer on one GPU without sequence parallelism: one
    packed call over every document, forward and backward."""
    pairs = sum(attention_pairs(n, n, True) for n in s.documents())
    d, h = s.head_dim, s.heads
    io = m.BF * rows * (2 * s.q + 2 * s.kv)
    fwd = Op(ATTN_FWD, flops=4.0 * pairs * h * d, bytes=float(io + m.F32 * h * rows), what="flash_forward")
    bwd = Op(ATTN_BWD, flops=10.0 * pairs * h * d, bytes=float(2 * io + m.F32 * h * rows), what="flash_backward")
    return fwd, bwd


def layer_forward(s: Shape, n: int, attn: list[Op]) -> list[Op]:
    """One decoder layer's forward on n rows with `attn` as its attention core."""
    h, i = s.hidden, s.intermediate
    return [*m.norm_fwd(n, h), *m.attention_proj_fwd(n, h, s.q, s.kv), *m.rope_fwd(n, s.heads, s.head_dim),
            *m.rope_fwd(n, s.kv_heads, s.head_dim), *attn, *m.linear_fwd(n, s.q, h), *m.add(n * h),
            *m.norm_fwd(n, h), *m.mlp_fwd(n, h, i), *m.add(n * h)]


def layer_backward(s: Shape, n: int, attn: list[Op]) -> list[Op]:
    h, i = s.hidden, s.intermediate
    return [*m.mlp_bwd(n, h, i), *m.norm_bwd(n, h), *m.add(n * h), *m.linear_bwd(n, s.q, h), *attn,
            *m.rope_bwd(n, s.kv_heads, s.head_dim), *m.rope_bwd(n, s.heads, s.head_dim),
            *m.attention_proj_bwd(n, h, s.q, s.kv), *m.norm_bwd(n, h), *m.add(n * h)]


def layer_ops(s: Shape) -> list[Op]:
    """Every op one decoder layer runs on this rank in one forward + backward."""
    fwd, bwd = _attention_kernels(s, s.rows)
    return layer_forward(s, s.rows, [fwd]) + layer_backward(s, s.rows, [bwd])


def step_ops(s: Shape) -> list[Op]:
    """What the step runs outside its decoder layers: embedding, rotary tables, final norm,
    LM head and loss, the kernels' cumulative lengths."""
    n, h = s.rows, s.hidden
    cu = Op(H2D, bytes=4.0 * (len(s.documents()) + 1), link="pcie", wire=4.0 * (len(s.documents()) + 1), what="h2d")
    return [*m.embedding(n, h, s.vocab), *m.rope_tables(n, s.head_dim), cu, cu, *m.norm_fwd(n, h),
            *m.linear_fwd(n, h, s.vocab), *m.loss_fwd_bwd(n, s.vocab), *m.linear_bwd(n, h, s.vocab), *m.norm_bwd(n, h)]


def step_inventory(s: Shape, layers: int) -> list[Op]:
    return step_ops(s) + [op for _ in range(layers) for op in layer_ops(s)]
