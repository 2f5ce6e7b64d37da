"""The pieces of the per-token memory budget: a phase (`Phase`: named tensors, their bytes), a
step's budget (`Budget`), the per-token sizes of the model's tensors (`Sizes`), the rows of
chunked parts, pinned host buffers as the pool allocates them, and the terms every preset
shares (FPDT's chunks on the host and its backward loop, an MLP chunk's backward, the loss).

Where it sits: below `capacity/budget.py` (layers run whole) and `capacity/layer_split_budget.py`
(memory="max"), which build their phases from these. Each term is the bytes of a tensor of the
census (`benchmarks/memory_budget.py`), written from the model's sizes, never fitted.
Symbols (v, qb, kvb, ib, lse): docs/DESIGN.md "The per-token memory budget"."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hf_longctx.data.model_dims import ModelDims
from hf_longctx.ops.host_pool import size_class
from hf_longctx.ops.loss_rows import loss_chunk_rows
from hf_longctx.ops.tiling import mlp_chunks_at

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
KERNEL_TERM = "attention kernel workspace (flash-attn 2 backward: fp32 dq accumulator, GQA dK/dV over the query heads)"


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
        return self.binding.terms.get(KERNEL_TERM, 0.0)


@dataclass(frozen=True)
class Sizes:
    dt: int
    v: float
    qb: float
    kvb: float
    ib: float
    lse: float
    rope: float
    mlp_saved: float  # I-wide tensors an unchunked MLP saves (gated: gate, up, act, product)

    @classmethod
    def of(cls, dims: ModelDims, dt: int, f: int) -> "Sizes":
        q, kv = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim * f
        return cls(dt, dt * dims.hidden, dt * q, dt * kv, dt * dims.intermediate, 4 * dims.heads,
                   2 * dt * dims.head_dim, (4 if dims.gated else 2) * dt * dims.intermediate)


def token_chunks(dims: ModelDims, mlp_chunks: int, s_local: int) -> int:
    """Row chunks of the token-wise parts (MLP, norms, a row-chunked layer's pieces) for a
    setting's MLP chunks (1: none; else the "auto" count, at least MIN_MLP_CHUNK_TOKENS rows)."""
    return 1 if mlp_chunks <= 1 else mlp_chunks_at(mlp_chunks, s_local, auto=True)


def loss_rows(dims: ModelDims, s_local: int, loss_chunks: int, chunk_rows: int = 0) -> int:
    """Tokens per LM-head chunk as `patch()` cuts them (`ops/loss_rows.loss_chunk_rows`):
    `loss_chunks` 0 = "auto" (`chunk_rows` rows when given), 1 = unchunked, N = N chunks."""
    chunks = "auto" if loss_chunks == 0 else None if loss_chunks == 1 else loss_chunks
    return loss_chunk_rows(dims.vocab, dims.hidden, max(1, s_local), chunks, chunk_rows or None)


def pinned(count: float, nbytes: float) -> float:
    """`count` pinned host buffers of `nbytes` each, as the pool allocates them (size classes)."""
    return count * size_class(int(math.ceil(nbytes)))


def fpdt_kept_host(z: Sizes, S: float, u: int) -> float:
    """FPDT's offloaded chunks of one layer kept for its backward: q, k, v, lse per chunk."""
    c = S / u
    return pinned(u, c * z.qb) + pinned(2 * u, c * z.kvb) + pinned(u, c * z.lse)


def fpdt_backward_host(z: Sizes, S: float, u: int) -> float:
    """What one layer's FPDT backward adds on the host: dout and out per chunk, dq sums (fp32)."""
    c = S / u
    return pinned(2 * u, c * z.qb) + pinned(u - 1, 2 * c * z.qb)


def fpdt_loop(z: Sizes, c: float) -> dict:
    """One step of FPDT's backward loop (K/V chunk outer, query chunks inner), chunk rows c."""
    return {"K/V chunk and the next one": 2 * c * 2 * z.kvb,
            "query chunks (this and the next): q, dout, out, lse, dq sum (fp32)": 2 * c * (5 * z.qb + z.lse),
            "kernel gradients and the K/V chunk's dK/dV sums (fp32)": c * (2 * z.qb + 2 * 4 * z.kvb),
            "finished dq of the outer chunk (fp32)": c * 2 * z.qb}


def mlp_chunk(z: Sizes, dims: ModelDims, rows: float) -> dict:
    """One token-wise chunk's backward: the MLP recomputed (its I-wide tensors and their
    gradients) and the norm before it (fp32 copies)."""
    h = dims.hidden
    return {"MLP chunk recompute (I-wide tensors and gradients)": rows * (z.mlp_saved + 2 * z.ib),
            "norm chunk (fp32 copy, normalized, output)": rows * (4 * h + 2 * z.v)}


def loss_terms(z: Sizes, dims: ModelDims, s: float, lr: int, chunked: bool) -> dict:
    v_, h = dims.vocab, dims.hidden
    if not chunked:
        return {"logits: log-softmax and two gradients (fp32)": 12 * v_ * s}
    # a chunk's log-softmax and its two gradients (fp32; the fp32 logits are freed before the
    # chunk's backward) and the fp32 weight-gradient sum its weight-gradient GEMM writes into
    # (ops/grad_sums.py: no weight-sized gradient per chunk); the first chunk's GEMM allocates
    # the sum after its fp32 tensors are freed, so one chunk alone never holds both
    chunk = 12 * lr * v_ + (4 * v_ * h if lr < s else 0.0)
    return {"final norm output (LM head input)": z.v * s, "gradient of the LM head input": z.v * s,
            "loss chunk (fp32 logits, log-softmax, gradients) and LM-head weight gradients": chunk}

