"""Local attention kernels that return (out, lse), per tile and over packed runs.

Where it sits: the innermost step of every attention path. Ring attention
(`ops/ring.py`), Ulysses (`ops/ulysses.py`), USP and FPDT (`ops/fpdt.py`) hand this
module the local queries and one block of keys, described by `data/layout.py` runs;
it plans tiles with `ops/blocks.py`, runs one kernel per tile and folds tiles with the
one merge of `ops/lse.py`. The backward takes the FINAL (merged over all key blocks)
out and lse, as in FlashAttention-2 (Dao 2023, Algorithm 2): P = exp(s - lse_final),
dS = P ⊙ (dP - rowsum(dout ⊙ out_final)); a caller holding keys in pieces (ring, FPDT
chunks) calls the backward once per piece and sums the gradients.

Kernels: CPU uses the aten flash op pair `_scaled_dot_product_flash_attention_for_cpu`
(+ `_backward`). Facts it relies on (torch 2.13): masks must be additive and of q's
dtype (a bool mask errors in forward and is misread in backward); the causal flag is
top-left aligned, so only square diagonal tiles use it; a fully masked row returns
lse = 0 (fixed to -inf here); a row with lse = -inf makes its backward NaN, so -inf is
passed as +inf, which zeroes P. The pure-torch math kernel of `ops/math_kernel.py`, chunked over query rows so
memory stays bounded, handles softcap (Gemma2) and any device/dtype without a fast op.
CUDA uses flash-attn's private forward/backward when `_compat.has_flash_attn()`, else
the math kernel: that branch is UNVERIFIED (no GPU was available when it was written).

Layout: q [B, H, Sq, D], k/v [B, H_kv, Sk, D], out [B, H, Sq, D] in q's dtype,
lse [B, H, Sq] float32 (float64 for float64 inputs, so float64 references stay exact).
"""

from __future__ import annotations

from typing import Sequence

import torch

from hf_longctx import _compat
from hf_longctx.data.layout import Run
from hf_longctx.ops.blocks import Block, block_mask, plan_blocks
from hf_longctx.ops.lse import merge
from hf_longctx.ops.math_kernel import NEG_INF as _NEG_INF
from hf_longctx.ops.math_kernel import acc_dtype as _acc_dtype
from hf_longctx.ops.math_kernel import check_tile as _check
from hf_longctx.ops.math_kernel import math_backward, math_forward

def _expand_kv(x: torch.Tensor, h: int) -> torch.Tensor:
    """[B, H_kv, S, D] -> [B, H, S, D], query head h reading kv head h // (H / H_kv) as HF's repeat_kv."""
    b, hkv, s, d = x.shape
    if hkv == h:
        return x
    return x[:, :, None].expand(b, hkv, h // hkv, s, d).reshape(b, h, s, d)  # [B, H_kv, G, S, D] -> [B, H, S, D]


def _reduce_kv(g: torch.Tensor, hkv: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, H, S, D] -> [B, H_kv, S, D]: sum the gradients of the query heads sharing a kv head."""
    if g.shape[1] == hkv:
        return g.to(dtype)
    return g.unflatten(1, (hkv, g.shape[1] // hkv)).sum(2, dtype=_acc_dtype(g.dtype)).to(dtype)  # [B, H_kv, G, S, D]


def empty_result(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of queries that attend no key: zeros and -inf (the merge identity)."""
    return torch.zeros_like(q), q.new_full(q.shape[:3], _NEG_INF, dtype=_acc_dtype(q.dtype))


def _backend(q: torch.Tensor, causal: bool, mask: torch.Tensor | None, softcap: float | None, sk: int) -> str:
    if q.device.type == "cpu":
        aten_ok = q.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
        return "aten" if softcap is None and aten_ok and _compat.has_cpu_flash_op() else "math"
    # flash-attn takes no arbitrary mask and aligns causal bottom-right: square tiles only.
    if q.device.type == "cuda" and mask is None and q.dtype in (torch.float16, torch.bfloat16):
        if (not causal or q.shape[2] == sk) and _compat.has_flash_attn():
            return "flash"
    return "math"


def _aten_mask(q: torch.Tensor, causal: bool, mask: torch.Tensor | None) -> tuple[bool, torch.Tensor | None]:
    if mask is None:
        return causal, None
    if causal:  # the op refuses is_causal together with a mask: fold the (top-left) causal rule in.
        mask = mask & torch.ones_like(mask).tril()
    return False, torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, _NEG_INF)


def _aten_forward(q, k, v, *, scale, causal, mask):
    is_causal, bias = _aten_mask(q, causal, mask)
    h = q.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, _expand_kv(k, h), _expand_kv(v, h), 0.0, is_causal, attn_mask=bias, scale=scale
    )
    if mask is not None:  # the op reports lse = 0 for a row with no allowed key
        empty_rows = ~(mask & torch.ones_like(mask).tril() if causal else mask).any(-1)  # [Sq]
        lse = lse.masked_fill(empty_rows, _NEG_INF)
    return out, lse.contiguous()  # the op lays lse out as [B, S, H] in memory; callers may view it


def _aten_backward(dout, q, k, v, out, lse, *, scale, causal, mask):
    is_causal, bias = _aten_mask(q, causal, mask)
    h, hkv = q.shape[1], k.shape[1]
    safe_lse = lse.masked_fill(torch.isneginf(lse), float("inf")).to(_acc_dtype(q.dtype))  # exp(s - inf) = 0
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, _expand_kv(k, h), _expand_kv(v, h), out, safe_lse, 0.0, is_causal, attn_mask=bias, scale=scale
    )
    return dq, _reduce_kv(dk, hkv, k.dtype), _reduce_kv(dv, hkv, v.dtype)


def _flash_forward(q, k, v, *, scale, causal, softcap):  # UNVERIFIED: needs a GPU with flash-attn >= 2.7
    from flash_attn import flash_attn_interface as fai

    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # [B, S, H(_kv), D], flash-attn's layout
    res = fai._flash_attn_forward(
        qt, kt, vt, dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=-1,
        window_size_right=-1, softcap=softcap or 0.0, alibi_slopes=None, return_softmax=False,
    )
    return res[0].transpose(1, 2), res[1].float()  # out [B, H, Sq, D], lse [B, H, Sq]


def _flash_backward(dout, q, k, v, out, lse, *, scale, causal, softcap):  # UNVERIFIED
    from flash_attn import flash_attn_interface as fai

    qt, kt, vt, ot, dot = (x.transpose(1, 2).contiguous() for x in (q, k, v, out, dout))  # [B, S, H(_kv), D]
    dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
    safe_lse = lse.masked_fill(torch.isneginf(lse), float("inf")).float().contiguous()
    fai._flash_attn_backward(
        dot, qt, kt, vt, ot, safe_lse, dq, dk, dv, dropout_p=0.0, softmax_scale=scale, causal=causal,
        window_size_left=-1, window_size_right=-1, softcap=softcap or 0.0, alibi_slopes=None,
        deterministic=False, rng_state=None,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)  # back to [B, H(_kv), S, D]


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
    mask: torch.Tensor | None, softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one tile. causal is top-left aligned (row i sees cols <= i); mask bool
    [Sq, Sk], True = attend, ANDed with causal. Rows with no key: out 0, lse -inf."""
    _check(q, k, v, mask)
    if q.shape[2] == 0 or k.shape[2] == 0:
        return empty_result(q)
    backend = _backend(q, causal, mask, softcap, k.shape[2])
    if backend == "aten":
        return _aten_forward(q, k, v, scale=scale, causal=causal, mask=mask)
    if backend == "flash":
        return _flash_forward(q, k, v, scale=scale, causal=causal, softcap=softcap)
    return math_forward(q, k, v, scale=scale, causal=causal, mask=mask, softcap=softcap)


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
    backend = _backend(q, causal, mask, softcap, k.shape[2])
    if backend == "aten":
        grads = _aten_backward(dout, q, k, v, out, lse, scale=scale, causal=causal, mask=mask)
    elif backend == "flash":
        grads = _flash_backward(dout, q, k, v, out, lse, scale=scale, causal=causal, softcap=softcap)
    else:
        return math_backward(
            dout, q, k, v, out, lse, scale=scale, causal=causal, mask=mask, softcap=softcap, grad_dtype=grad_dtype
        )
    return grads if grad_dtype is None else tuple(g.to(grad_dtype) for g in grads)


def _check_runs(x: torch.Tensor, runs: Sequence[Run], name: str) -> None:
    total = sum(r.length for r in runs)
    if total != x.shape[2]:
        raise ValueError(f"{name} runs cover {total} tokens but the tensor holds S = {x.shape[2]} (shape {tuple(x.shape)})")


def _plan(q, k, q_runs, k_runs, causal, window, blocks=None):
    _check_runs(q, q_runs, "q")
    _check_runs(k, k_runs, "k")
    if blocks is None:
        blocks = plan_blocks(q_runs, k_runs, causal=causal, window=window)
    masks = [block_mask(b, causal=causal, window=window, device=q.device) if b.kind == "masked" else None for b in blocks]
    return blocks, masks


def _whole(blocks, q, k) -> bool:
    """One tile covering every local query and key: call the kernel on the tensors as they are."""
    return len(blocks) == 1 and blocks[0][:4] == (0, q.shape[2], 0, k.shape[2])


def _assemble(
    pieces: dict[tuple[int, int], torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype, device, fill: float
) -> torch.Tensor:
    """Concatenate disjoint ranges of dim 2 (S) in order, `fill` in the gaps. One
    allocation written once: a zero-filled buffer plus in-place adds would touch every
    fresh page twice, which costs several % of a CPU attention step."""
    parts, at = [], 0
    for (lo, hi), piece in sorted(pieces.items()):
        if lo > at:
            parts.append(torch.full((*shape[:2], lo - at, *shape[3:]), fill, dtype=dtype, device=device))
        parts.append(piece.to(dtype))
        at = hi
    if at < shape[2]:
        parts.append(torch.full((*shape[:2], shape[2] - at, *shape[3:]), fill, dtype=dtype, device=device))
    return parts[0] if len(parts) == 1 else torch.cat(parts, 2)  # [B, H, S, (D)] along S


def _summed(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Sum of gradient pieces of the same rows, in float32 (float64) so bf16 rounds once."""
    if len(pieces) == 1:
        return pieces[0]
    total = pieces[0].to(_acc_dtype(pieces[0].dtype))
    for piece in pieces[1:]:
        total = total + piece
    return total


def varlen_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_runs: Sequence[Run], k_runs: Sequence[Run], *,
    scale: float, causal: bool, window: int | None = None, softcap: float | None = None,
    blocks: Sequence[Block] | None = None, out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the local queries (q_runs) over the local keys (k_runs) of packed
    documents: out [B, H, Sq, D] (`out_dtype`, default q's dtype), lse [B, H, Sq]; rows
    with no allowed key give out 0, lse -inf. Callers that merge this partial result with
    others (ring steps, FPDT chunks) ask for float32 so that it is rounded once, at the end."""
    _check(q, k, v)
    blocks, masks = _plan(q, k, q_runs, k_runs, causal, window, blocks)
    fwd = dict(scale=scale, softcap=softcap)
    out_dtype = out_dtype or q.dtype
    if _whole(blocks, q, k):
        out, lse = block_forward(q, k, v, causal=blocks[0].kind == "causal", mask=masks[0], **fwd)
        return out.to(out_dtype), lse
    if _backend(q, causal, None, softcap, k.shape[2]) == "aten":  # expand GQA heads once, not per tile
        k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    outs, lses = {}, {}
    for b, m in zip(blocks, masks):  # tiles of one query run merge into the same rows
        o, l = block_forward(
            q[:, :, b.q_lo:b.q_hi], k[:, :, b.k_lo:b.k_hi], v[:, :, b.k_lo:b.k_hi],
            causal=b.kind == "causal", mask=m, **fwd,
        )  # o [B, H, nq, D], l [B, H, nq]
        rows = (b.q_lo, b.q_hi)
        if rows in outs:
            outs[rows], lses[rows] = merge(outs[rows], lses[rows], o, l)
        else:
            outs[rows], lses[rows] = o, l
    return (
        _assemble(outs, q.shape, out_dtype, q.device, 0.0),
        _assemble(lses, q.shape[:3], _acc_dtype(q.dtype), q.device, _NEG_INF),
    )


def varlen_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    q_runs: Sequence[Run], k_runs: Sequence[Run], *,
    scale: float, causal: bool, window: int | None = None, softcap: float | None = None,
    grad_dtype: torch.dtype | None = None, blocks: Sequence[Block] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq [B, H, Sq, D], dk, dv [B, H_kv, Sk, D]) of the attention of q over
    THESE keys, given the final out/lse (merged over every key block the caller holds).
    `grad_dtype` as in `block_backward`: float32 for callers that keep summing."""
    _check(q, k, v)
    if dout.shape != q.shape or out.shape != q.shape or lse.shape != q.shape[:3]:
        raise ValueError(
            f"dout/out must be {tuple(q.shape)} and lse {tuple(q.shape[:3])}, "
            f"got dout {tuple(dout.shape)}, out {tuple(out.shape)}, lse {tuple(lse.shape)}"
        )
    blocks, masks = _plan(q, k, q_runs, k_runs, causal, window, blocks)
    bwd = dict(scale=scale, softcap=softcap)
    if _whole(blocks, q, k):
        return block_backward(
            dout, q, k, v, out, lse, causal=blocks[0].kind == "causal", mask=masks[0], grad_dtype=grad_dtype, **bwd
        )
    hkv, k_in, v_in = k.shape[1], k, v
    acc = _acc_dtype(q.dtype)
    if _backend(q, causal, None, softcap, k.shape[2]) == "aten":
        k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    dqs, dks, dvs = {}, {}, {}
    for b, m in zip(blocks, masks):
        qs, ks = slice(b.q_lo, b.q_hi), slice(b.k_lo, b.k_hi)
        gq, gk, gv = block_backward(
            dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs], lse[:, :, qs],
            causal=b.kind == "causal", mask=m, grad_dtype=acc, **bwd,
        )  # tiles stay in the accumulation dtype until they are summed
        dqs.setdefault((b.q_lo, b.q_hi), []).append(gq)
        dks.setdefault((b.k_lo, b.k_hi), []).append(gk)
        dvs.setdefault((b.k_lo, b.k_hi), []).append(gv)
    # Sums of tiles and of GQA heads stay in the accumulation dtype: one rounding at the end.
    dq = _assemble({r: _summed(p) for r, p in dqs.items()}, q.shape, grad_dtype or q.dtype, q.device, 0.0)
    dk = _assemble({r: _summed(p) for r, p in dks.items()}, k.shape, acc, k.device, 0.0)  # [B, H(_kv), Sk, D]
    dv = _assemble({r: _summed(p) for r, p in dvs.items()}, v.shape, acc, v.device, 0.0)
    return dq, _reduce_kv(dk, hkv, grad_dtype or k_in.dtype), _reduce_kv(dv, hkv, grad_dtype or v_in.dtype)


class LocalAttention(torch.autograd.Function):
    """Differentiable `varlen_forward`: saves q, k, v, out, lse; the lse itself gets no gradient."""

    @staticmethod
    def forward(ctx, q, k, v, q_runs, k_runs, scale, causal, window, softcap, blocks=None):
        out, lse = varlen_forward(
            q, k, v, q_runs, k_runs, scale=scale, causal=causal, window=window, softcap=softcap, blocks=blocks
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (list(q_runs), list(k_runs), dict(scale=scale, causal=causal, window=window, softcap=softcap, blocks=blocks))
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        q_runs, k_runs, kw = ctx.args
        dq, dk, dv = varlen_backward(dout.contiguous(), q, k, v, out, lse, q_runs, k_runs, **kw)
        return dq, dk, dv, None, None, None, None, None, None, None


def local_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_runs: Sequence[Run], k_runs: Sequence[Run], *,
    scale: float, causal: bool, window: int | None = None, softcap: float | None = None,
    blocks: Sequence[Block] | None = None,
) -> torch.Tensor:
    """out [B, H, Sq, D] of the local attention, differentiable w.r.t. q, k, v; `blocks`
    is the precomputed `plan_blocks(q_runs, k_runs, ...)` if the caller has it."""
    return LocalAttention.apply(q, k, v, q_runs, k_runs, scale, causal, window, softcap, blocks)
