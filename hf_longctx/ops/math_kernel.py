"""The blockwise math kernel: exact attention of one tile with its log-sum-exp, in pure torch.

Where it sits: the last-resort backend of `ops/backends/` and the reference the fused
kernels are tested against: softcap on CPU (Gemma2), float64 references, and CUDA dtypes,
head dims or architectures no fused kernel takes.
Guarantees: memory bounded at any length (query × key chunks sized by BYTES, online softmax
across key chunks, FlashAttention §3.1); K/V cast one key chunk at a time; GQA through
broadcast [B, H_kv, G, ...] views, never copies; the backward runs from the FINAL out/lse
(FlashAttention-2, Algorithm 2). Accumulation in float32 (float64 for float64 inputs).
Layout: q [B, H, Sq, D], k/v [B, H_kv, Sk, D]."""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
# Score-sized tensors alive at once inside a chunk (s, p, dp, ds in the backward).
_LIVE = 4
# Bytes one chunk's score tensors may hold: 64 MiB on CPU (cache-friendly; the size the
# kernel always used), 1/8 of the free memory on CUDA (at 128K keys a 4M-score cap meant
# tens of thousands of Python iterations per tile).
_CPU_BUDGET = 64 << 20


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_tile(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [B, H, S, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, h, sq, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or k.shape[1] < 1 or h % k.shape[1]:
        raise ValueError(
            f"k/v must be [B={b}, H_kv, Sk, D={d}] with H={h} divisible by H_kv and k.shape == v.shape, "
            f"got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (sq, k.shape[2])):
        raise ValueError(f"mask must be bool [Sq={sq}, Sk={k.shape[2]}], got {mask.dtype} {tuple(mask.shape)}")


def budget_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(_CPU_BUDGET, free // 8)
    return _CPU_BUDGET


def chunk_shape(q: torch.Tensor, sk: int) -> tuple[int, int]:
    """(query rows, key columns) per chunk so that `_LIVE` score tensors
    [B, H, rows, cols] in the accumulation dtype fit `budget_bytes`. Key columns are
    only cut when even 128 query rows against all keys would not fit."""
    b, h, sq, _ = q.shape
    per_score = _LIVE * torch.finfo(acc_dtype(q.dtype)).bits // 8 * max(1, b * h)
    scores = max(1, budget_bytes(q.device) // per_score)
    cols = sk if scores // max(1, sk) >= min(sq, 128) else max(1, scores // min(sq, 128))
    return max(1, scores // cols), cols


def _allowed(lo: int, hi: int, c0: int, c1: int, causal: bool, mask: torch.Tensor | None, device) -> torch.Tensor | None:
    """bool [rows, cols] of query rows lo:hi × key columns c0:c1, or None if all allowed."""
    allowed = None if mask is None else mask[lo:hi, c0:c1]
    if causal:  # top-left aligned, like the aten op
        tri = torch.arange(lo, hi, device=device)[:, None] >= torch.arange(c0, c1, device=device)[None, :]
        allowed = tri if allowed is None else allowed & tri
    return allowed


def _scores(q5c, kc, *, scale, softcap, allowed):
    """Scores of a chunk: [B, H_kv, G, rows, cols] and tanh(s / softcap) (None without softcap)."""
    s = q5c @ kc.unsqueeze(2).transpose(-1, -2) * scale  # [B, H_kv, G, rows, D] @ [B, H_kv, 1, D, cols]
    t = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s = softcap * t
    if allowed is not None:
        s = s.masked_fill(~allowed, NEG_INF)
    return s, t


def _finite(x: torch.Tensor) -> torch.Tensor:
    """-inf -> 0: a stand-in that keeps exp(s - x) = 0 (s = -inf) instead of NaN."""
    return x.masked_fill(torch.isneginf(x), 0.0)


def math_forward(
    q, k, v, *, scale: float, causal: bool, mask: torch.Tensor | None, softcap: float | None,
    out_dtype: torch.dtype | None = None,
):
    """Reference-grade blockwise kernel; same contract as `block_forward`. `out_dtype`
    (default q's dtype): float32 hands a partial result to a merge without rounding."""
    check_tile(q, k, v, mask)
    b, h, sq, d = q.shape
    hkv, sk, acc = k.shape[1], k.shape[2], acc_dtype(q.dtype)
    q5 = q.unflatten(1, (hkv, h // hkv))  # [B, H_kv, G, Sq, D]: GQA by broadcasting, no kv copy
    out = torch.empty(q.shape, dtype=out_dtype or q.dtype, device=q.device)
    lse = q.new_empty((b, h, sq), dtype=acc)
    out5, lse5 = out.unflatten(1, (hkv, h // hkv)), lse.unflatten(1, (hkv, h // hkv))  # views [B, H_kv, G, ...]
    rows, cols = chunk_shape(q, sk)
    for lo in range(0, sq, rows):
        hi = min(sq, lo + rows)
        qc = q5[..., lo:hi, :].to(acc)
        o = l = None
        for c0 in range(0, sk, cols):
            c1 = min(sk, c0 + cols)
            kc, vc = k[:, :, c0:c1].to(acc), v[:, :, c0:c1].to(acc)  # cast one key chunk at a time
            s, _ = _scores(qc, kc, scale=scale, softcap=softcap, allowed=_allowed(lo, hi, c0, c1, causal, mask, q.device))
            lc = torch.logsumexp(s, -1)  # [B, H_kv, G, rows]; -inf for a row with no key here
            if l is None:
                o, l = torch.exp(s - _finite(lc).unsqueeze(-1)) @ vc.unsqueeze(2), lc  # [B, H_kv, G, rows, D]
                continue
            new = torch.logaddexp(l, lc)  # online softmax: rescale what is there, add this chunk
            ref = _finite(new).unsqueeze(-1)
            o = o * torch.exp(l.unsqueeze(-1) - ref) + torch.exp(s - ref) @ vc.unsqueeze(2)
            l = new
        out5[..., lo:hi, :] = o
        lse5[..., lo:hi] = l
    return out, lse


def math_backward(
    dout, q, k, v, out, lse, *, scale: float, causal: bool, mask: torch.Tensor | None, softcap: float | None,
    grad_dtype: torch.dtype | None = None,
):
    """Gradients of this tile given the final out/lse; same contract as `block_backward`."""
    check_tile(q, k, v, mask)
    b, h, sq, d = q.shape
    hkv, sk, acc = k.shape[1], k.shape[2], acc_dtype(q.dtype)
    g = h // hkv
    q5, do5, o5 = (x.unflatten(1, (hkv, g)) for x in (q, dout, out))  # [B, H_kv, G, Sq, D]
    safe_lse = lse.masked_fill(torch.isneginf(lse), float("inf")).to(acc).unflatten(1, (hkv, g))  # [B, H_kv, G, Sq]
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # cast once at the end, not per chunk
    dq5 = dq.unflatten(1, (hkv, g))
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    rows, cols = chunk_shape(q, sk)
    for lo in range(0, sq, rows):
        hi = min(sq, lo + rows)
        qc, doc = q5[..., lo:hi, :].to(acc), do5[..., lo:hi, :].to(acc)
        delta = (doc * o5[..., lo:hi, :].to(acc)).sum(-1, keepdim=True)  # rowsum(dO ⊙ O) [B, H_kv, G, rows, 1]
        for c0 in range(0, sk, cols):
            c1 = min(sk, c0 + cols)
            kc, vc = k[:, :, c0:c1].to(acc), v[:, :, c0:c1].to(acc)
            allowed = _allowed(lo, hi, c0, c1, causal, mask, q.device)
            s, t = _scores(qc, kc, scale=scale, softcap=softcap, allowed=allowed)
            p = torch.exp(s - safe_lse[..., lo:hi].unsqueeze(-1))  # [B, H_kv, G, rows, cols]
            ds = p * (doc @ vc.unsqueeze(2).transpose(-1, -2) - delta)
            if t is not None:  # d(c·tanh(x/c))/dx = 1 - tanh²
                ds = ds * (1 - t * t)
            dq5[..., lo:hi, :] += (ds @ kc.unsqueeze(2)) * scale  # [B, H_kv, G, rows, D]
            dk[:, :, c0:c1] += (ds.transpose(-1, -2) @ qc).sum(2) * scale  # [B, H_kv, cols, D], summed over G
            dv[:, :, c0:c1] += (p.transpose(-1, -2) @ doc).sum(2)
    return dq.to(grad_dtype or q.dtype), dk.to(grad_dtype or k.dtype), dv.to(grad_dtype or v.dtype)
