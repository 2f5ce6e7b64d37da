"""Packed (varlen) driver: the planned tiles of a call become a few cumulative-length calls.

Where it sits: the backends whose kernel takes many documents in one call -- flash-attn
2.x (`flash_attn.py`) and torch's CUDA flash kernels (`torch_flash.py`). `ops/kernels.py`
hands it the blocks of `ops/blocks.py`; it plans sequences and waves (`sequences.py`),
calls the kernel once per wave and scatters the results back.
Guarantees: waves merge with `ops/lse.merge_` into one float32 accumulator and round
once; the backward reuses the waves and returns the kernel's gradients untouched when one
call covers every row, else sums them in float32.
Layout: q [B, H, Sq, D] -> gathered [B·n, H, D]; lse [H, B·n] from the kernel -> [B, H, n]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from hf_longctx.ops.backends.sequences import sequences, waves
from hf_longctx.ops.blocks import Block
from hf_longctx.ops.lse import merge_
from hf_longctx.ops.math_kernel import NEG_INF, acc_dtype
from hf_longctx.devices import upload


def _index(ranges: Sequence[tuple[int, int]], total: int, device) -> torch.Tensor | None:
    """Row index of the concatenated ranges, or None when they are exactly 0..total."""
    if ranges and ranges[0][0] == 0 and ranges[-1][1] == total and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])):
        return None
    return upload(torch.cat([torch.arange(lo, hi) for lo, hi in ranges]), device)  # [n] int64


def _cu(lengths: Sequence[int], batch: int, device) -> tuple[torch.Tensor, int]:
    """int32 cumulative lengths of `lengths` repeated for every batch row, and the max."""
    per_batch = [n for _ in range(batch) for n in lengths]
    cu = torch.tensor([0, *per_batch], dtype=torch.int64).cumsum(0).to(torch.int32)
    return upload(cu, device), max(lengths)


def _gather(x_t: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    """[B, S, H, D] rows idx -> [B·n, H, D] contiguous (one copy)."""
    picked = x_t if idx is None else x_t.index_select(1, idx)
    return picked.reshape(-1, *x_t.shape[2:])


def _kernel_max_k(right: int, max_k: int) -> int:
    """The max_seqlen_k a call hands the kernel. flash-attn 2 (and torch's vendored copy)
    turns window_size_right >= max_seqlen_k into -1, unbounded: a trimmed causal tile with
    more rows than keys (right = q_end - k_end >= its key count) would then let its first
    rows see later keys. max_seqlen_k only sizes the grid (blocks past a sequence's own
    length exit at once), so it is raised above the window instead. (left >= max_seqlen_k
    becomes -1 too, which is harmless: such a bound is below key 0 for every row.)"""
    return max(max_k, right + 1)


@dataclass(frozen=True)
class _Call:
    q_idx: torch.Tensor | None
    k_idx: torch.Tensor | None
    nq: int
    nk: int
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    causal: bool
    left: int
    right: int


def _calls(blocks, q, k, causal, window) -> list[_Call]:
    """The kernel calls of a plan; kept in the plan's `memo` (`ops/blocks.Tiles`) so that
    every layer of a micro-batch reuses the same device tensors (no rebuild, no upload)."""
    memo = getattr(blocks, "memo", None)
    key = ("packed", q.shape[0], q.shape[2], k.shape[2], q.device, causal, window)
    if memo is not None and key in memo:
        return memo[key]
    calls = _plan_calls(blocks, q, k, causal, window)
    if memo is not None:
        memo[key] = calls
    return calls


def _plan_calls(blocks, q, k, causal, window) -> list[_Call]:
    calls = []
    for wave in waves(sequences(blocks, causal=causal, window=window)):
        q_ranges = [s.q for s in wave]
        k_ranges = [r for s in wave for r in s.k]
        cu_q, max_q = _cu([hi - lo for lo, hi in q_ranges], q.shape[0], q.device)
        cu_k, max_k = _cu([sum(hi - lo for lo, hi in s.k) for s in wave], q.shape[0], q.device)
        left, right = wave[0].left, wave[0].right  # the band that opened the wave
        max_k = _kernel_max_k(right, max_k)
        assert right < max_k, (right, max_k)  # never a window flash-attn reads as unbounded
        is_causal = (left, right) == (-1, 0)  # the kernels' own causal path (bottom-right)
        calls.append(_Call(
            _index(q_ranges, q.shape[2], q.device), _index(k_ranges, k.shape[2], k.device),
            sum(hi - lo for lo, hi in q_ranges), sum(hi - lo for lo, hi in k_ranges),
            cu_q, cu_k, max_q, max_k, is_causal, -1 if is_causal else left, -1 if is_causal else right,
        ))
    return calls


@dataclass(frozen=True)
class PackedBackend:
    """A varlen kernel adapter (`forward(qp, kp, vp, cu_q, cu_k, max_q, max_k, *, scale,
    causal, left, right, softcap) -> (out [T, H, D], lse [H, T] fp32, -inf for empty rows)`
    and the matching `backward`) behind the (out, lse) contract of `ops/kernels.py`."""

    name: str
    kernel: object

    def forward(self, q, k, v, blocks: Sequence[Block], *, scale, causal, window, softcap, out_dtype, widen=True):
        """`widen=False`: one call's output comes back in the kernel's dtype when `out_dtype`
        is wider (the kernel rounded it already; the caller merges it as it is, `lse.merge_`)."""
        b, h, sq, d = q.shape
        acc = acc_dtype(q.dtype)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, S, H(_kv), D] views
        calls = _calls(blocks, q, k, causal, window)
        out = lse = None
        for c in calls:
            o, l = self.kernel.forward(
                _gather(qt, c.q_idx), _gather(kt, c.k_idx), _gather(vt, c.k_idx), c.cu_q, c.cu_k, c.max_q, c.max_k,
                scale=scale, causal=c.causal, left=c.left, right=c.right, softcap=softcap,
            )  # o [B·nq, H, D], l [B·nq] per head: [H, B·nq]
            o = o.view(b, c.nq, h, d).transpose(1, 2)  # [B, H, nq, D]
            l = l.view(h, b, c.nq).transpose(0, 1)  # [B, H, nq]
            if out is None:  # the first call: its rows start the result, the rest attend nothing yet (0, -inf)
                dtype = acc if len(calls) > 1 else o.dtype  # several calls: the float32 accumulator of merge_
                if c.q_idx is None:
                    out, lse = o.to(dtype), l
                else:
                    out = o.new_zeros((b, h, sq, d), dtype=dtype).index_copy_(2, c.q_idx, o.to(dtype))  # [B, H, Sq, D]
                    lse = l.new_full((b, h, sq), NEG_INF).index_copy_(2, c.q_idx, l)  # [B, H, Sq]
                continue
            if c.q_idx is None:
                out, lse = merge_(out, lse, o, l)
                continue
            rows, rows_lse = merge_(out.index_select(2, c.q_idx), lse.index_select(2, c.q_idx), o, l)  # [B, H, nq, (D)]
            out.index_copy_(2, c.q_idx, rows)
            lse.index_copy_(2, c.q_idx, rows_lse)
        if out is None:  # no tile at all
            return q.new_zeros(q.shape, dtype=out_dtype), q.new_full(q.shape[:3], NEG_INF, dtype=acc)
        keep = not widen and out.dtype == q.dtype and out_dtype.itemsize > out.dtype.itemsize
        return (out if keep else out.to(out_dtype)), lse.to(acc)

    def backward(self, dout, q, k, v, out, lse, blocks: Sequence[Block], *, scale, causal, window, softcap, grad_dtype):
        b, h, sq, d = q.shape
        hkv, sk, acc = k.shape[1], k.shape[2], acc_dtype(q.dtype)
        qt, kt, vt, dot = (x.transpose(1, 2) for x in (q, k, v, dout))  # [B, S, H(_kv), D] views
        ot = out.to(q.dtype).transpose(1, 2)  # the kernels take out in q's dtype (for rowsum(dO ⊙ O))
        lse_t = lse.to(acc).permute(1, 0, 2)  # [H, B, Sq], float32 (the kernels' lse dtype)
        calls = _calls(blocks, q, k, causal, window)
        if len(calls) == 1 and calls[0].q_idx is None and calls[0].k_idx is None:
            return self._one_call_backward(calls[0], dot, qt, kt, vt, ot, lse_t, (q, k, v), scale, softcap, grad_dtype)
        # Sums over calls in float32 (one rounding at the end); a tensor's first contribution
        # that covers all its rows is taken as the kernel returned it (no zeros to add into).
        grads: list[torch.Tensor | None] = [None, None, None]  # [B, S, H(_kv), D] like the kernel's rows
        shapes = ((b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d))
        for c in calls:
            l = lse_t if c.q_idx is None else lse_t.index_select(2, c.q_idx)
            gq, gk, gv = self.kernel.backward(
                _gather(dot, c.q_idx), _gather(qt, c.q_idx), _gather(kt, c.k_idx), _gather(vt, c.k_idx),
                _gather(ot, c.q_idx), l.reshape(h, b * c.nq), c.cu_q, c.cu_k, c.max_q, c.max_k,
                scale=scale, causal=c.causal, left=c.left, right=c.right, softcap=softcap,
            )  # [B·nq, H, D], [B·nk, H_kv, D] x2
            for i, (idx, g, n) in enumerate(((c.q_idx, gq, c.nq), (c.k_idx, gk, c.nk), (c.k_idx, gv, c.nk))):
                g = g.view(b, n, *g.shape[1:])  # [B, n, H(_kv), D]
                if grads[i] is None and idx is None:
                    grads[i] = g
                elif grads[i] is None:
                    grads[i] = torch.zeros(shapes[i], dtype=acc, device=g.device).index_add_(1, idx, g.to(acc))
                elif idx is None:
                    grads[i] = grads[i].to(acc).add_(g)
                else:
                    grads[i] = grads[i].to(acc).index_add_(1, idx, g.to(acc))
        return tuple(
            torch.zeros(shape, dtype=grad_dtype or t.dtype, device=t.device).transpose(1, 2) if x is None
            else x.transpose(1, 2).to(grad_dtype or t.dtype)
            for x, t, shape in zip(grads, (q, k, v), shapes)
        )  # [B, H(_kv), S, D]

    def _one_call_backward(self, c: _Call, dot, qt, kt, vt, ot, lse_t, qkv, scale, softcap, grad_dtype):
        """One kernel call covers every row of q, k and v: its gradients ARE the result (no
        fp32 scratch, no index_add; the kernel rounded them once)."""
        b, sq, h, d = qt.shape
        grads = self.kernel.backward(
            _gather(dot, None), _gather(qt, None), _gather(kt, None), _gather(vt, None), _gather(ot, None),
            lse_t.reshape(h, b * sq), c.cu_q, c.cu_k, c.max_q, c.max_k,
            scale=scale, causal=c.causal, left=c.left, right=c.right, softcap=softcap,
        )  # [B·Sq, H, D], [B·Sk, H_kv, D] x2
        return tuple(
            g.view(b, -1, *g.shape[1:]).transpose(1, 2).to(grad_dtype or t.dtype) for g, t in zip(grads, qkv)
        )  # [B, H(_kv), S, D]

