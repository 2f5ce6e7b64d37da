"""Packed (varlen) driver: the planned tiles of a call become a few cumulative-length calls.

Where it sits: the backends whose kernel takes many documents in one call -- flash-attn
2.x (`flash_attn.py`), torch's CUDA flash kernels (`torch_flash.py`), cuDNN through torch's
ops (`cudnn.py`) and through cudnn-frontend (`cudnn_frontend.py`). `ops/kernels.py` hands it
the blocks of `ops/blocks.py`; it plans sequences and waves (`sequences.py`; every causal
call square for a top-left kernel, `square_causal.py`), calls the kernel once per wave and
scatters the results back.
Guarantees: waves merge with `ops/lse.merge_` into one float32 accumulator (the caller's,
when it holds one: ring steps, FPDT chunks) and round once; the backward reuses the waves,
returns the kernel's gradients untouched when one call covers every row, else adds them
into float32 sums in place (the caller's, when it holds them). Rows that are one
contiguous range (a zigzag half of one document) are read and written through views, never
gathered (`_rows`); only scattered rows take an index.
Layout: q [B, H, Sq, D] -> gathered [B·n, H, D]; lse [H, B·n] from the kernel -> [B, H, n]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch

from hf_longctx.ops.backends.sequences import sequences, waves
from hf_longctx.ops.backends.square_causal import square_sequences
from hf_longctx.ops.blocks import Block
from hf_longctx.ops.lse import merge_
from hf_longctx.ops.math_kernel import NEG_INF, acc_dtype
from hf_longctx.devices import upload

Rows = Union[None, tuple, torch.Tensor]  # all rows / one (lo, hi) range / an int64 index (`_rows`)


def _rows(ranges: Sequence[tuple[int, int]], total: int, device) -> Rows:
    """The rows of a call: None when they are exactly 0..total, (lo, hi) when they are one
    contiguous range (read and written through views: a zigzag half of one document), else
    the int64 index of the concatenated ranges."""
    ranges = _coalesced(ranges)
    if len(ranges) == 1:
        return None if ranges[0] == (0, total) else ranges[0]
    return upload(torch.cat([torch.arange(lo, hi) for lo, hi in ranges]), device)  # [n] int64


def _coalesced(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        elif hi > lo:
            out.append((lo, hi))
    return out


def _cu(lengths: Sequence[int], batch: int, device) -> tuple[torch.Tensor, int]:
    """int32 cumulative lengths of `lengths` repeated for every batch row, and the max."""
    per_batch = [n for _ in range(batch) for n in lengths]
    cu = torch.tensor([0, *per_batch], dtype=torch.int64).cumsum(0).to(torch.int32)
    return upload(cu, device), max(lengths)


def _pick(x: torch.Tensor, rows: Rows, dim: int) -> torch.Tensor:
    """Rows `rows` of x along `dim`: a view for None and a range, a gather for an index."""
    if rows is None:
        return x
    if isinstance(rows, tuple):
        return x.narrow(dim, rows[0], rows[1] - rows[0])
    return x.index_select(dim, rows)


def _gather(x_t: torch.Tensor, rows: Rows) -> torch.Tensor:
    """[B, S, H, D] rows -> [B·n, H, D] (a view when B = 1 and the rows are one range)."""
    return _pick(x_t, rows, 1).reshape(-1, *x_t.shape[2:])


def _add(total: torch.Tensor, rows: Rows, g: torch.Tensor) -> None:
    """total[:, rows] += g along dim 1, in place: a mixed-dtype add of a view (a bf16 piece
    into a float32 sum, no widened copy) for None and a range; index_add_ for an index, which
    needs g in total's dtype (the one widened copy: of this call's rows only)."""
    if rows is None or isinstance(rows, tuple):
        _pick(total, rows, 1).add_(g)
    else:
        total.index_add_(1, rows, g.to(total.dtype))


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
    q_idx: Rows
    k_idx: Rows
    nq: int
    nk: int
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    causal: bool
    left: int
    right: int


def _calls(blocks, q, k, causal, window, square: bool = False) -> list[_Call]:
    """The kernel calls of a plan; kept in the plan's `memo` (`ops/blocks.Tiles`) so that
    every layer of a micro-batch reuses the same device tensors (no rebuild, no upload).
    `square`: the kernel's causal flag is top-left aligned (`square_causal.py`)."""
    memo = getattr(blocks, "memo", None)
    key = ("packed", q.shape[0], q.shape[2], k.shape[2], q.device, causal, window, square)
    if memo is not None and key in memo:
        return memo[key]
    calls = _plan_calls(blocks, q, k, causal, window, square)
    if memo is not None:
        memo[key] = calls
    return calls


def _plan_calls(blocks, q, k, causal, window, square: bool = False) -> list[_Call]:
    calls = []
    seqs = sequences(blocks, causal=causal, window=window)
    for wave in waves(square_sequences(seqs) if square else seqs, bottom_right=not square):
        q_ranges = [s.q for s in wave]
        k_ranges = [r for s in wave for r in s.k]
        cu_q, max_q = _cu([hi - lo for lo, hi in q_ranges], q.shape[0], q.device)
        cu_k, max_k = _cu([sum(hi - lo for lo, hi in s.k) for s in wave], q.shape[0], q.device)
        left, right = wave[0].left, wave[0].right  # the band that opened the wave
        max_k = _kernel_max_k(right, max_k)
        assert right < max_k, (right, max_k)  # never a window flash-attn reads as unbounded
        is_causal = (left, right) == (-1, 0)  # the kernels' own causal path (bottom-right; square under `square`)
        calls.append(_Call(
            _rows(q_ranges, q.shape[2], q.device), _rows(k_ranges, k.shape[2], k.device),
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

    @property
    def square(self) -> bool:
        """The kernel's causal flag is top-left aligned: every causal call is made square."""
        return bool(getattr(self.kernel, "square_causal", False))

    def forward(self, q, k, v, blocks: Sequence[Block], *, scale, causal, window, softcap, out_dtype, widen=True, into=None):
        """`widen=False`: one call's output comes back in the kernel's dtype when `out_dtype`
        is wider (the kernel rounded it already; the caller merges it as it is, `lse.merge_`).
        `into=(out, lse)`: the caller's float32 accumulators [B, H, Sq, D] / [B, H, Sq]; every
        call folds into the rows it computes, in place, and they are returned."""
        b, h, sq, d = q.shape
        acc = acc_dtype(q.dtype)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, S, H(_kv), D] views
        calls = _calls(blocks, q, k, causal, window, self.square)
        if into is None and len(calls) == 1 and calls[0].q_idx is None:  # one call covers every row: its result
            o, lse = self._forward(calls[0], qt, kt, vt, (b, h, d), scale, softcap)
            keep = not widen and o.dtype == q.dtype and out_dtype.itemsize > o.dtype.itemsize
            return (o if keep else o.to(out_dtype)), lse.to(acc)
        if into is None:  # rows no call covers attend nothing: (0, -inf), the merge's identity
            out = q.new_zeros((b, sq, h, d), dtype=acc).transpose(1, 2)  # [B, H, Sq, D] view of [B, Sq, H, D]: token-major
            into = out, q.new_full(q.shape[:3], NEG_INF, dtype=acc)
        out, lse = into
        for c in calls:
            o, l = self._forward(c, qt, kt, vt, (b, h, d), scale, softcap)  # [B, H, nq, D], [B, H, nq]
            if c.q_idx is None or isinstance(c.q_idx, tuple):  # the rows are a view: merged in place
                merge_(_pick(out, c.q_idx, 2), _pick(lse, c.q_idx, 2), o, l)
                continue
            rows, rows_lse = merge_(out.index_select(2, c.q_idx), lse.index_select(2, c.q_idx), o, l)  # [B, H, nq, (D)]
            out.index_copy_(2, c.q_idx, rows)
            lse.index_copy_(2, c.q_idx, rows_lse)
        return out, lse

    def _forward(self, c: _Call, qt, kt, vt, bhd, scale, softcap) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, d = bhd
        o, l = self.kernel.forward(
            _gather(qt, c.q_idx), _gather(kt, c.k_idx), _gather(vt, c.k_idx), c.cu_q, c.cu_k, c.max_q, c.max_k,
            scale=scale, causal=c.causal, left=c.left, right=c.right, softcap=softcap,
        )  # o [B·nq, H, D], l [B·nq] per head: [H, B·nq]
        return o.view(b, c.nq, h, d).transpose(1, 2), l.view(h, b, c.nq).transpose(0, 1)  # [B, H, nq, D], [B, H, nq]

    def backward(
        self, dout, q, k, v, out, lse, blocks: Sequence[Block], *, scale, causal, window, softcap, grad_dtype,
        widen=True, into=(None, None, None),
    ):
        """`into`: per gradient (dq, dk, dv) None or the caller's float32 sum [B, H(_kv), S, D],
        which the calls add into in place (and which is returned). The others: one call's
        gradient as the kernel returned it (cast to `grad_dtype` unless `widen=False`), or
        the float32 sum of several calls' pieces."""
        b, h, sq, d = q.shape
        hkv, sk, acc = k.shape[1], k.shape[2], acc_dtype(q.dtype)
        qt, kt, vt, dot = (x.transpose(1, 2) for x in (q, k, v, dout))  # [B, S, H(_kv), D] views
        ot = out.to(q.dtype).transpose(1, 2)  # the kernels take out in q's dtype (for rowsum(dO ⊙ O))
        lse_t = lse.to(acc).permute(1, 0, 2)  # [H, B, Sq], float32 (the kernels' lse dtype)
        calls = _calls(blocks, q, k, causal, window, self.square)
        # Sums in float32 (one rounding, by the caller); a tensor's only piece covering all its
        # rows is taken as the kernel returned it (no zeros to add into, no widened copy).
        sums = [None if t is None else t.transpose(1, 2) for t in into]  # [B, S, H(_kv), D] views
        shapes = ((b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d))
        for c in calls:
            l = _pick(lse_t, c.q_idx, 2)
            gq, gk, gv = self.kernel.backward(
                _gather(dot, c.q_idx), _gather(qt, c.q_idx), _gather(kt, c.k_idx), _gather(vt, c.k_idx),
                _gather(ot, c.q_idx), l.reshape(h, b * c.nq), c.cu_q, c.cu_k, c.max_q, c.max_k,
                scale=scale, causal=c.causal, left=c.left, right=c.right, softcap=softcap,
            )  # [B·nq, H, D], [B·nk, H_kv, D] x2
            for i, (rows, g, n) in enumerate(((c.q_idx, gq, c.nq), (c.k_idx, gk, c.nk), (c.k_idx, gv, c.nk))):
                g = g.view(b, n, *g.shape[1:])  # [B, n, H(_kv), D]
                if sums[i] is None and rows is None:
                    sums[i] = g if len(calls) == 1 else g.to(acc)  # the sole piece, or the float32 sum's start
                    continue
                if sums[i] is None:
                    sums[i] = torch.zeros(shapes[i], dtype=acc, device=g.device)  # rows no call covers: 0
                _add(sums[i], rows, g)
        grads = []
        for i, (x, t) in enumerate(zip(sums, (q, k, v))):
            if into[i] is not None:
                grads.append(into[i])
            elif x is None:
                grads.append(torch.zeros(t.shape, dtype=grad_dtype or t.dtype, device=t.device))
            else:
                x, target = x.transpose(1, 2), grad_dtype or t.dtype  # [B, H(_kv), S, D]
                keep = not widen and x.dtype == t.dtype and target.itemsize > x.dtype.itemsize
                grads.append(x if keep else x.to(target))
        return tuple(grads)
