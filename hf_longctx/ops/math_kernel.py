"""The blockwise math kernel: exact attention of one tile with its log-sum-exp, in pure torch.

Where it sits: `ops/kernels.py` dispatches a tile here when no fused op can run it --
logit softcapping (Gemma2: score = c·tanh(s/c), which the aten CPU flash op lacks), any
dtype or device without a fast op (float64 references, CUDA without flash-attn). Query
rows are processed in chunks so one score tile stays near 4M elements (memory bounded as
in FlashAttention's tiling, Dao 2022 §3.1). The backward follows FlashAttention-2
(Dao 2023, Algorithm 2) from the FINAL out/lse, so ring and FPDT callers can sum tiles.

Layout: q [B, H, Sq, D], k/v [B, H_kv, Sk, D]; GQA by broadcasting [B, H_kv, G, ...]
views, never copying K/V. Accumulation in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


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


def _math_chunk_allowed(lo: int, hi: int, sk: int, causal: bool, mask: torch.Tensor | None, device) -> torch.Tensor | None:
    allowed = None if mask is None else mask[lo:hi]
    if causal:  # top-left aligned, like the aten op
        tri = torch.arange(lo, hi, device=device)[:, None] >= torch.arange(sk, device=device)[None, :]
        allowed = tri if allowed is None else allowed & tri
    return allowed  # [rows, Sk] or None


def _math_rows(q: torch.Tensor, sk: int, budget: int = 1 << 22) -> int:
    """Query rows per chunk so that one score tile holds about `budget` elements."""
    return max(1, budget // max(1, q.shape[0] * q.shape[1] * sk))


def _math_scores(q5c, k, *, scale, softcap, allowed):
    """Scores of a chunk: [B, H_kv, G, rows, Sk] and tanh(s / softcap) (None without softcap)."""
    s = q5c @ k.unsqueeze(2).transpose(-1, -2) * scale  # [B, H_kv, G, rows, D] @ [B, H_kv, 1, D, Sk]
    t = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s = softcap * t
    if allowed is not None:
        s = s.masked_fill(~allowed, NEG_INF)
    return s, t


def math_forward(q, k, v, *, scale: float, causal: bool, mask: torch.Tensor | None, softcap: float | None):
    """Reference-grade blockwise kernel in float32 (float64 for float64 inputs); same contract as `block_forward`,
    except that out stays in the accumulation dtype: `varlen_forward` rounds it once, to its
    `out_dtype` -- q's dtype, or float32 for ring/FPDT callers that keep merging partials."""
    check_tile(q, k, v, mask)
    b, h, sq, d = q.shape
    hkv, sk, acc = k.shape[1], k.shape[2], acc_dtype(q.dtype)
    q5 = q.unflatten(1, (hkv, h // hkv))  # [B, H_kv, G, Sq, D]: GQA by broadcasting, no kv copy
    kc, vc = k.to(acc), v.to(acc)
    out, lse = q.new_empty(q.shape, dtype=acc), q.new_empty((b, h, sq), dtype=acc)
    out5, lse5 = out.unflatten(1, (hkv, h // hkv)), lse.unflatten(1, (hkv, h // hkv))  # views [B, H_kv, G, ...]
    step = _math_rows(q, sk)
    for lo in range(0, sq, step):
        hi = min(sq, lo + step)
        allowed = _math_chunk_allowed(lo, hi, sk, causal, mask, q.device)
        s, _ = _math_scores(q5[..., lo:hi, :].to(acc), kc, scale=scale, softcap=softcap, allowed=allowed)
        l = torch.logsumexp(s, -1)  # [B, H_kv, G, rows]; -inf for a row with no key
        p = torch.exp(s - l.masked_fill(torch.isneginf(l), 0.0).unsqueeze(-1))
        out5[..., lo:hi, :] = p @ vc.unsqueeze(2)  # [B, H_kv, G, rows, D]
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
    kc, vc = k.to(acc), v.to(acc)
    dq = torch.empty(q.shape, dtype=acc, device=q.device)  # cast once at the end, not per row chunk
    dq5 = dq.unflatten(1, (hkv, g))
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    step = _math_rows(q, sk)
    for lo in range(0, sq, step):
        hi = min(sq, lo + step)
        allowed = _math_chunk_allowed(lo, hi, sk, causal, mask, q.device)
        qc, doc, oc = (x[..., lo:hi, :].to(acc) for x in (q5, do5, o5))
        s, t = _math_scores(qc, kc, scale=scale, softcap=softcap, allowed=allowed)
        p = torch.exp(s - safe_lse[..., lo:hi].unsqueeze(-1))  # [B, H_kv, G, rows, Sk]
        dp = doc @ vc.unsqueeze(2).transpose(-1, -2)  # [B, H_kv, G, rows, Sk]
        ds = p * (dp - (doc * oc).sum(-1, keepdim=True))
        if t is not None:  # d(c·tanh(x/c))/dx = 1 - tanh²
            ds = ds * (1 - t * t)
        dq5[..., lo:hi, :] = (ds @ kc.unsqueeze(2)) * scale  # [B, H_kv, G, rows, D]
        dk += (ds.transpose(-1, -2) @ qc).sum(2) * scale  # [B, H_kv, Sk, D], summed over G
        dv += (p.transpose(-1, -2) @ doc).sum(2)
    return dq.to(grad_dtype or q.dtype), dk.to(grad_dtype or k.dtype), dv.to(grad_dtype or v.dtype)
