"""The aten CPU flash op pair as a per-tile kernel: what CPU training runs.

Where it sits: the tile kernel of the "aten_cpu" backend (`tiled.py` drives it tile by
tile); calls `torch.ops.aten._scaled_dot_product_flash_attention_for_cpu` and its
`_backward` (torch 2.13 schema). It corrects the op's conventions: masks are passed
additive in q's dtype, the causal flag only on square diagonal tiles (top-left aligned),
a fully masked row's lse 0 becomes -inf (and -inf is passed back as +inf, which zeroes P),
K/V heads are expanded for GQA.
Layout: q [B, H, Sq, D], k/v [B, H_kv, Sk, D]; out in q's dtype (fp32 for callers that
merge), lse [B, H, Sq] float32."""

from __future__ import annotations

import torch

from hf_longctx.ops.math_kernel import NEG_INF, acc_dtype


def expand_kv(x: torch.Tensor, h: int) -> torch.Tensor:
    """[B, H_kv, S, D] -> [B, H, S, D], query head h reading kv head h // (H / H_kv) as HF's repeat_kv."""
    b, hkv, s, d = x.shape
    if hkv == h:
        return x
    return x[:, :, None].expand(b, hkv, h // hkv, s, d).reshape(b, h, s, d)  # [B, H_kv, G, S, D] -> [B, H, S, D]


def reduce_kv(g: torch.Tensor, hkv: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, H, S, D] -> [B, H_kv, S, D]: sum the gradients of the query heads sharing a kv head."""
    if g.shape[1] == hkv:
        return g.to(dtype)
    return g.unflatten(1, (hkv, g.shape[1] // hkv)).sum(2, dtype=acc_dtype(g.dtype)).to(dtype)  # [B, H_kv, G, S, D]


def _additive(q: torch.Tensor, causal: bool, mask: torch.Tensor | None) -> tuple[bool, torch.Tensor | None]:
    if mask is None:
        return causal, None
    if causal:  # the op refuses is_causal together with a mask: fold the (top-left) causal rule in.
        mask = mask & torch.ones_like(mask).tril()
    return False, torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, NEG_INF)


def _widened(out_dtype, *tensors):
    """A caller that keeps merging (ring steps, FPDT chunks, tiles) asks for fp32 results; the
    op rounds its outputs to its input dtype, so bf16/fp16 tiles are computed in fp32 instead
    (the CPU kernel computes in fp32 internally anyway) and the merge rounds once, at the end."""
    low = tensors[0].dtype in (torch.bfloat16, torch.float16)
    if out_dtype is None or not low or out_dtype in (torch.bfloat16, torch.float16):
        return tensors
    return tuple(t.to(out_dtype) for t in tensors)


def aten_forward(q, k, v, *, scale, causal, mask, softcap=None, out_dtype=None):
    """out [B, H, Sq, D] (q's dtype, or fp32 when asked: see `_widened`), lse [B, H, Sq]."""
    q, k, v = _widened(out_dtype, q, k, v)
    is_causal, bias = _additive(q, causal, mask)
    h = q.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, expand_kv(k, h), expand_kv(v, h), 0.0, is_causal, attn_mask=bias, scale=scale
    )
    if mask is not None:  # the op reports lse = 0 for a row with no allowed key
        empty_rows = ~(mask & torch.ones_like(mask).tril() if causal else mask).any(-1)  # [Sq]
        lse = lse.masked_fill(empty_rows, NEG_INF)
    return out, lse.contiguous()  # the op lays lse out as [B, S, H] in memory; callers may view it


def aten_backward(dout, q, k, v, out, lse, *, scale, causal, mask, softcap=None, grad_dtype=None):
    k_dtype, v_dtype = k.dtype, v.dtype
    dout, q, k, v, out = _widened(grad_dtype, dout, q, k, v, out)
    is_causal, bias = _additive(q, causal, mask)
    h, hkv = q.shape[1], k.shape[1]
    safe_lse = lse.masked_fill(torch.isneginf(lse), float("inf")).to(acc_dtype(q.dtype))  # exp(s - inf) = 0
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, expand_kv(k, h), expand_kv(v, h), out.to(q.dtype), safe_lse, 0.0, is_causal, attn_mask=bias, scale=scale
    )
    # GQA heads summed in fp32 and rounded once, to the dtype the caller accumulates in.
    return dq.to(grad_dtype or q.dtype), reduce_kv(dk, hkv, grad_dtype or k_dtype), reduce_kv(dv, hkv, grad_dtype or v_dtype)
