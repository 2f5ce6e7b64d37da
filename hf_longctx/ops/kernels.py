"""Local attention that returns (out, lse), per tile and over packed runs.

Where it sits: the innermost step of every attention path (ring, Ulysses, USP, FPDT):
given local queries and one block of keys as runs of `hf_longctx/layout.py`, it plans
tiles (`ops/blocks.py`), uses ONE backend per call -- the caller's, chosen once per
micro-batch (`batch_backend`), or `ops/backends/select.py`'s pick -- and hands it the whole
plan. The backward takes the FINAL (merged over all key blocks) out and lse
(FlashAttention-2, Algorithm 2), so a caller holding keys in pieces sums per-piece gradients.
Layout: q [B, H, Sq, D], k/v [B, H_kv, Sk, D], out [B, H, Sq, D] (`out_dtype`, default
q's dtype), lse [B, H, Sq] float32 (float64 for float64 inputs, so references stay exact)."""

from __future__ import annotations

from typing import Sequence

import torch

from hf_longctx.layout import Run
from hf_longctx.ops.backends import backend_for
from hf_longctx.ops.blocks import Block, Tiles, plan_blocks
from hf_longctx.ops.math_kernel import NEG_INF as _NEG_INF
from hf_longctx.ops.math_kernel import acc_dtype as _acc_dtype
from hf_longctx.ops.math_kernel import check_tile as _check


def empty_result(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of queries that attend no key: zeros and -inf (the merge identity)."""
    return torch.zeros_like(q), q.new_full(q.shape[:3], _NEG_INF, dtype=_acc_dtype(q.dtype))


def _tile_blocks(q, k, causal: bool) -> list[Block]:
    """One tile as a plan: square causal tiles keep the kernel's causal path; a
    non-square causal tile is top-left aligned (our convention), i.e. "masked" from
    position 0."""
    sq, sk = q.shape[2], k.shape[2]
    kind = "full" if not causal else ("causal" if sq == sk else "masked")
    return [Block(0, sq, 0, sk, kind, 0, 0)]


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
    mask: torch.Tensor | None, softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one tile. causal is top-left aligned (row i sees cols <= i); mask bool
    [Sq, Sk], True = attend, ANDed with causal. Rows with no key: out 0, lse -inf. The
    tile-level entry the kernel tests compare the math kernel against (the library itself
    calls varlen_forward)."""
    _check(q, k, v, mask)
    if q.shape[2] == 0 or k.shape[2] == 0:
        return empty_result(q)
    backend = backend_for(q, softcap=softcap, mask=mask is not None)
    if mask is not None:
        return backend.tile_forward(q, k, v, scale=scale, causal=causal, mask=mask, softcap=softcap)
    blocks = _tile_blocks(q, k, causal)
    return backend.forward(q, k, v, blocks, scale=scale, causal=causal, window=None, softcap=softcap, out_dtype=q.dtype)


def block_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    *, scale: float, causal: bool, mask: torch.Tensor | None, softcap: float | None,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq [B, H, Sq, D], dk, dv [B, H_kv, Sk, D]) of this tile's share, given the FINAL out/lse.

    Gradients come in `grad_dtype` (default: the inputs' dtype). Callers that sum tiles
    (ring, FPDT) ask for float32 so a bf16 gradient is rounded once, at the very end; the
    fused ops round their own output, the math kernel does not have to.
    """
    _check(q, k, v, mask)
    if q.shape[2] == 0 or k.shape[2] == 0:
        return tuple(torch.zeros(t.shape, dtype=grad_dtype or t.dtype, device=t.device) for t in (q, k, v))
    backend = backend_for(q, softcap=softcap, mask=mask is not None)
    kw = dict(scale=scale, causal=causal, softcap=softcap, grad_dtype=grad_dtype)
    if mask is not None:
        return backend.tile_backward(dout, q, k, v, out, lse, mask=mask, **kw)
    return backend.backward(dout, q, k, v, out, lse, _tile_blocks(q, k, causal), window=None, **kw)


def batch_backend(q: torch.Tensor, *, softcap: float | None, memo: dict | None, window: int | None = None,
                  choice=None):
    """The backend of `q`'s calls for the lifetime of `memo` -- a dict the caller keeps per
    micro-batch (`patch()`'s plan cache, an `FPDTPlan`): `backend_for` (the environment probe
    and the refusal checks) runs once per (device, dtype, head dim, softcap, window, choice)
    and micro-batch, not once per call of every layer; without a memo, once per call.
    `choice`: the caller's `ops/backends/select.AttentionChoice` (a named backend, the GPU's
    measured ranking), None for the unmeasured default.
    Per micro-batch, not per process: torch's flash implementation is a process-wide switch the
    user may flip between steps (`_compat.torch_flash_impl`), so a choice kept for the process
    could go stale; kept for one micro-batch, its forward, recompute and backward run one kernel."""
    if memo is None:
        return backend_for(q, softcap=softcap, window=window, choice=choice)
    key = ("backend", q.device, q.dtype, q.shape[-1], softcap, window, choice)
    backend = memo.get(key)
    if backend is None:
        backend = memo[key] = backend_for(q, softcap=softcap, window=window, choice=choice)
    return backend


def _check_runs(x: torch.Tensor, runs: Sequence[Run], name: str) -> None:
    total = sum(r.length for r in runs)
    if total != x.shape[2]:
        raise ValueError(f"{name} runs cover {total} tokens but the tensor holds S = {x.shape[2]} (shape {tuple(x.shape)})")


def _plan(q, k, q_runs, k_runs, causal, window, blocks=None) -> list[Block]:
    _check_runs(q, q_runs, "q")
    _check_runs(k, k_runs, "k")
    if blocks is None:
        return plan_blocks(q_runs, k_runs, causal=causal, window=window)
    return blocks if isinstance(blocks, Tiles) else list(blocks)  # a plan's Tiles keep their memo


def varlen_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_runs: Sequence[Run], k_runs: Sequence[Run], *,
    scale: float, causal: bool, window: int | None = None, softcap: float | None = None,
    blocks: Sequence[Block] | None = None, out_dtype: torch.dtype | None = None, backend=None, widen: bool = True,
    into: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the local queries (q_runs) over the local keys (k_runs) of packed
    documents: out [B, H, Sq, D] (`out_dtype`, default q's dtype), lse [B, H, Sq]; rows
    with no allowed key give out 0, lse -inf. Callers that merge this partial result with
    others (ring steps, FPDT chunks) ask for float32 so that it is rounded once, at the end
    (exact on the math kernel; the fused kernels round their own output, see
    `ops/backends/capabilities.py`). `widen=False`: a fused kernel's output may come back
    in its own (q's) dtype instead of a widened copy -- for callers that fold it into a
    float32 accumulator with `ops/lse.merge_`, which reads it as it is. `into=(out, lse)`:
    the caller's float32 accumulators of the same rows, into which the result is merged in
    place (`ops/lse.merge_`, only the rows the plan computes) and which are returned.
    `backend`: a backend of `ops/backends` to use instead of the one `select.py` picks
    (tests, emulated kernels)."""
    _check(q, k, v)
    plan = _plan(q, k, q_runs, k_runs, causal, window, blocks)
    out_dtype = out_dtype or q.dtype
    if not plan or q.shape[2] == 0 or k.shape[2] == 0:
        if into is not None:
            return into  # merging "no key" changes nothing
        out, lse = empty_result(q)
        return out.to(out_dtype), lse
    backend = backend or backend_for(q, softcap=softcap, window=window)
    out, lse = backend.forward(
        q, k, v, plan, scale=scale, causal=causal, window=window, softcap=softcap, out_dtype=out_dtype, widen=widen,
        **({} if into is None else {"into": into}),
    )
    return (out if not widen or into is not None else out.to(out_dtype)), lse


def varlen_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    q_runs: Sequence[Run], k_runs: Sequence[Run], *,
    scale: float, causal: bool, window: int | None = None, softcap: float | None = None,
    grad_dtype: torch.dtype | None = None, blocks: Sequence[Block] | None = None, backend=None,
    widen: bool = True, into: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq [B, H, Sq, D], dk, dv [B, H_kv, Sk, D]) of the attention of q over
    THESE keys, given the final out/lse (merged over every key block the caller holds).
    `grad_dtype` as in `block_backward`: float32 for callers that keep summing; with
    `widen=False` a fused kernel's gradient may come back in its own (q's) dtype instead of
    a widened copy. `into=(dq, dk, dv)`, each None or the caller's float32 sum: the gradient
    is added into it in place (only the rows the plan touches) and it is returned."""
    _check(q, k, v)
    if dout.shape != q.shape or out.shape != q.shape or lse.shape != q.shape[:3]:
        raise ValueError(
            f"dout/out must be {tuple(q.shape)} and lse {tuple(q.shape[:3])}, "
            f"got dout {tuple(dout.shape)}, out {tuple(out.shape)}, lse {tuple(lse.shape)}"
        )
    plan = _plan(q, k, q_runs, k_runs, causal, window, blocks)
    into = (None, None, None) if into is None else tuple(into)
    if not plan or q.shape[2] == 0 or k.shape[2] == 0:
        return tuple(
            s if s is not None else torch.zeros(t.shape, dtype=grad_dtype or t.dtype, device=t.device)
            for s, t in zip(into, (q, k, v))
        )
    backend = backend or backend_for(q, softcap=softcap, window=window)
    extra = {} if widen and all(s is None for s in into) else {"widen": widen, "into": into}
    return backend.backward(
        dout, q, k, v, out, lse, plan, scale=scale, causal=causal, window=window, softcap=softcap, grad_dtype=grad_dtype,
        **extra,
    )


class LocalAttention(torch.autograd.Function):
    """Differentiable `varlen_forward`: saves q, k, v, out, lse; the lse itself gets no gradient."""

    @staticmethod
    def forward(ctx, q, k, v, q_runs, k_runs, scale, causal, window, softcap, blocks=None, backend=None):
        kw = dict(scale=scale, causal=causal, window=window, softcap=softcap, blocks=blocks, backend=backend)
        out, lse = varlen_forward(q, k, v, q_runs, k_runs, **kw)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (list(q_runs), list(k_runs), kw)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        q_runs, k_runs, kw = ctx.args
        # dout as autograd hands it: the packed backends gather it token-major (a view when
        # it already is), the tile kernels read any strides; a .contiguous() would copy it.
        dq, dk, dv = varlen_backward(dout, q, k, v, out, lse, q_runs, k_runs, **kw)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def local_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_runs: Sequence[Run], k_runs: Sequence[Run], *,
    scale: float, causal: bool, window: int | None = None, softcap: float | None = None,
    blocks: Sequence[Block] | None = None, backend=None,
) -> torch.Tensor:
    """out [B, H, Sq, D] of the local attention, differentiable w.r.t. q, k, v; `blocks`
    is the precomputed `plan_blocks(q_runs, k_runs, ...)` if the caller has it; `backend`
    the one the caller chose (`batch_backend`), else `varlen_forward` picks."""
    return LocalAttention.apply(q, k, v, q_runs, k_runs, scale, causal, window, softcap, blocks, backend)
