"""The GPU ops one call of each part of a Llama-style decoder runs, in closed form.

Where it sits: the vocabulary of `capacity/inventory.py`, which composes these calls in the
order and number the patched step runs them (per memory preset and mesh). Each function
returns the `capacity/op_cost.Op`s of one call on `n` rows (tokens), one Op per kernel,
with HBM bytes counted as `benchmarks/_op_stream.py` counts them (every operand read, every
result written; a broadcast operand once). They are the aten ops HF's Llama modules dispatch
in bf16 (transformers 5.x: RMSNorm in fp32, rotate-half RoPE, SiLU-gated MLP), checked against
the recorded stream by tests/unit/test_step_model.py. Under `patch(fused=True)` each compiled
region (`integrations/fusion.py`) is one kernel per pass that reads its inputs and writes its
outputs once (`fused`): what inductor generates for it, counted on CPU by
tests/unit/test_fused_kernels.py."""

from __future__ import annotations

from hf_longctx.capacity.op_cost import ELEMENTWISE, GEMM, Op

BF, F32, I64 = 2, 4, 8  # bytes per element


def ew(*sizes: float, what: str = "") -> list[Op]:
    """One elementwise kernel per entry, its HBM bytes."""
    return [Op(ELEMENTWISE, bytes=float(b), what=what) for b in sizes]


def mm(m: float, k: float, n: float, what: str = "mm") -> Op:
    """[m, k] @ [k, n] in bf16."""
    return Op(GEMM, flops=2.0 * m * k * n, bytes=float(BF * (m * k + k * n + m * n)), what=what)


def linear_fwd(n: float, d_in: float, d_out: float) -> list[Op]:
    return [mm(n, d_in, d_out)]


def wgrad(d_out: float, n: float, d_in: float, fresh: bool) -> Op:
    """A chunk's weight gradient g^T x written into the weight's fp32 sum by one GEMM
    (`ops/grad_sums.accumulate_mm_`: on CUDA the sum is the GEMM's C); `fresh`: the chunk
    that starts the sum (beta 0: C written, not read)."""
    c = F32 * d_out * d_in
    return Op(GEMM, flops=2.0 * d_out * n * d_in, bytes=float(BF * (d_out * n + n * d_in) + (c if fresh else 2 * c)),
              what="wgrad")


def linear_bwd(n: float, d_in: float, d_out: float, fresh: bool | None = None) -> list[Op]:
    """dW = g^T x and dx = g W (dx first or second: same work); with `fresh` (a row chunk's
    backward under a `GradSums`) dW goes into its fp32 sum (`wgrad`)."""
    return [mm(d_out, n, d_in) if fresh is None else wgrad(d_out, n, d_in, fresh), mm(n, d_out, d_in)]


def norm_fwd(n: float, h: float, fused: bool = False) -> list[Op]:
    """LlamaRMSNorm: to fp32, pow, mean, +eps, rsqrt, scale, to bf16, weight (`fused`: one kernel)."""
    if fused:
        return fused_norm(n, h)
    x = n * h
    return ew(BF * x + F32 * x, 2 * F32 * x, F32 * x + F32 * n, 2 * F32 * n, 2 * F32 * n, 2 * F32 * x + F32 * n,
              F32 * x + BF * x, 2 * BF * x + BF * h, what="norm")


def norm_bwd(n: float, h: float, fused: bool = False) -> list[Op]:
    if fused:
        return fused_norm(n, h, backward=True)
    x = n * h
    return ew(2 * BF * x + BF * h, 3 * BF * x, BF * x + BF * h, BF * x + F32 * x, 3 * F32 * x, 2 * F32 * x + F32 * n,
              F32 * x + F32 * n, 2 * F32 * n, 2 * F32 * n, 3 * F32 * n, F32 * n + F32 * x, 2 * F32 * x, 2 * F32 * x,
              3 * F32 * x, 3 * F32 * x, F32 * x + BF * x, what="norm")


def rope_fwd(n: float, heads: float, d: float) -> list[Op]:
    """x·cos + rotate_half(x)·sin on [1, heads, n, d] (cos/sin [1, 1, n, d] broadcast)."""
    x, c = n * heads * d, n * d
    return ew(2 * BF * x + BF * c, BF * x, 2 * BF * x, 2 * BF * x + BF * c, 3 * BF * x, what="rope")


def rope_bwd(n: float, heads: float, d: float) -> list[Op]:
    x, c = n * heads * d, n * d
    return ew(2 * BF * x + BF * c, BF * x, 1.5 * BF * x, 1.5 * BF * x, 3 * BF * x, 2 * BF * x + BF * c, 3 * BF * x,
              what="rope")


def rope_pair(n: float, heads: float, kv_heads: float, d: float, backward: bool = False,
              fused: bool = False) -> list[Op]:
    """RoPE of q and of k (their backwards in the autograd engine's order, k first); `fused`:
    the compiled `apply_rotary_pos_emb`, both in one kernel."""
    if fused:
        return fused_rope(n, heads, kv_heads, d)
    if backward:
        return [*rope_bwd(n, kv_heads, d), *rope_bwd(n, heads, d)]
    return [*rope_fwd(n, heads, d), *rope_fwd(n, kv_heads, d)]


def rope_tables(n: float, d: float) -> list[Op]:
    """The model's rotary embedding: cos/sin [1, n, d] from the positions (once per forward)."""
    c = n * d
    return ew(I64 * n + F32 * n, F32 * n + F32 * d / 2 + F32 * c / 2, 2 * F32 * c, 2 * F32 * c, 2 * F32 * c,
              2 * F32 * c, 2 * F32 * c, F32 * c + BF * c, F32 * c + BF * c, what="rope")


def mlp_fwd(n: float, h: float, i: float, fused: bool = False) -> list[Op]:
    """down(silu(gate(x)) * up(x)); `fused`: silu and the product one kernel (`gated_product`)."""
    if fused:
        return [mm(n, h, i), mm(n, h, i), *ew(3 * BF * n * i, what="fused mlp"), mm(n, i, h)]
    return [mm(n, h, i), *ew(2 * BF * n * i, what="mlp"), mm(n, h, i), *ew(3 * BF * n * i, what="mlp"), mm(n, i, h)]


def mlp_bwd(n: float, h: float, i: float, fresh: bool | None = None, fused: bool = False) -> list[Op]:
    """`fused`: the product's and silu's backward one kernel (gate and up in, their gradients out)."""
    if fused:
        return [*linear_bwd(n, i, h, fresh), *ew(5 * BF * n * i, what="fused mlp"), *linear_bwd(n, h, i, fresh),
                *linear_bwd(n, h, i, fresh), *add(n * h)]
    return [*linear_bwd(n, i, h, fresh), *ew(3 * BF * n * i, 3 * BF * n * i, what="mlp"), *linear_bwd(n, h, i, fresh),
            *ew(3 * BF * n * i, what="mlp"), *linear_bwd(n, h, i, fresh), *add(n * h)]


def fused_norm(n: float, h: float, backward: bool = False) -> list[Op]:
    """A compiled RMSNorm: x and the weight in, y out; backward: x, dy and the weight in, dx
    and the weight's (fp32) gradient out."""
    x = n * h
    return ew(3 * BF * x + BF * h + F32 * h if backward else 2 * BF * x + BF * h, what="fused norm")


def fused_rope(n: float, heads: float, kv_heads: float, d: float) -> list[Op]:
    """The compiled `apply_rotary_pos_emb` (q and k in one kernel), forward or backward alike:
    q, k (or their gradients) and cos, sin in, the rotated pair out."""
    return ew(2 * BF * n * (heads + kv_heads) * d + 2 * BF * n * d, what="fused rope")


def add(x: float, dtype: int = BF) -> list[Op]:
    """a + b -> c over x elements."""
    return ew(3 * dtype * x, what="add")


def copy(x: float, src: int = BF, dst: int = BF, what: str = "copy") -> list[Op]:
    """A copy of x elements (a dtype cast when src != dst)."""
    return ew(src * x + dst * x, what=what)


def attention_proj_fwd(n: float, h: float, q: float, kv: float) -> list[Op]:
    return [*linear_fwd(n, h, q), *linear_fwd(n, h, kv), *linear_fwd(n, h, kv)]


def attention_proj_bwd(n: float, h: float, q: float, kv: float, fresh: bool | None = None) -> list[Op]:
    """v's gradient comes token-major from the kernel; k's and q's head-major from RoPE's
    backward, hence one contiguous copy each; the three input gradients summed."""
    return [*linear_bwd(n, h, kv, fresh), *copy(n * kv), *linear_bwd(n, h, kv, fresh), *add(n * h), *copy(n * q),
            *linear_bwd(n, h, q, fresh), *add(n * h)]


def loss_fwd_bwd(n: float, v: float) -> list[Op]:
    """HF's cross-entropy on fp32 logits [n, v] (bf16 logits in), forward and backward."""
    x = n * v
    return ew(BF * x + F32 * x, 2 * F32 * x, F32 * x + I64 * n + 2 * F32, 2 * F32, 2 * F32, 2 * F32,
              2 * F32 * x + I64 * n + 2 * F32, 3 * F32 * x, F32 * x + BF * x, what="loss")


def fused_loss(n: float, v: float) -> list[Op]:
    """The model's loss function compiled over whole fp32-upcast logits [n, v] (bf16 in): its
    forward (log-sum-exp and the targets' logits: the logits read, the fp32 log-sum-exp saved),
    the backward's seed (a one, as `loss_fwd_bwd` counts it) and its backward (the logits read
    again, their gradient written)."""
    x = n * v
    return ew(BF * x + I64 * n + F32 * n + F32, 2 * F32, 2 * BF * x + F32 * n + I64 * n + F32, what="fused loss")


def cross_entropy_tail(n: float, v: float) -> list[Op]:
    """`ops/fused.cross_entropy_tail` on one chunk's logits [n, v]: read twice (log-sum-exp,
    then the gradient), the gradient written, the chunk's loss summed, in one kernel."""
    return ew(3 * BF * n * v + I64 * n + F32, what="fused loss")


def embedding(n: float, h: float, vocab: float) -> list[Op]:
    """Lookup forward and dense backward (the recorder counts the whole table)."""
    b = BF * vocab * h + I64 * n + BF * n * h
    return ew(b, b, what="embedding")
