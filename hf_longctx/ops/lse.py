"""The one log-sum-exp merge of partial attention results.

Where it sits: every algorithm that splits an attention's keys into disjoint sets (ring
ranks, FPDT chunks, key runs of a packed batch) folds each partial (out, lse) in here: the
online softmax of FlashAttention (§3.1) across devices, as in Ring Attention (§3), USP
Algorithm 2 and FPDT §3.3:
    l = log(exp(l_A) + exp(l_B)),  o = exp(l_A - l) · o_A + exp(l_B - l) · o_B.
Guarantees: lse = -inf means "no keys yet" (weight 0; two empty sets stay out 0, lse -inf,
never NaN); `merge_` folds in place into a caller-owned float32 accumulator (out AND lse,
which may be views of rows of larger accumulators) with no [B, H, S, D] temporary; `merge`
returns a fresh result. Sinks are this merge with a key set of output 0 (`ops/sinks.py`)."""

from __future__ import annotations

import torch


def _acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float32, or float64 when any input already is float64 (float64 reference tests)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check(out, lse, block_out, block_lse) -> None:
    if out.shape != block_out.shape or lse.shape != block_lse.shape or out.shape[:-1] != lse.shape:
        raise ValueError(
            f"merge needs out/block_out [B, H, S, D] and lse/block_lse [B, H, S] of equal shapes, got "
            f"out {tuple(out.shape)}, lse {tuple(lse.shape)}, block_out {tuple(block_out.shape)}, "
            f"block_lse {tuple(block_lse.shape)}"
        )


def merge_(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the partial result (block_out, block_lse) INTO the accumulator (out, lse), in place.

    out [B, H, S, D]: float32 (float64) and the caller's own (it is overwritten); block_out
    [B, H, S, D] in any floating dtype, read as it is (a bf16 kernel output needs no widened
    copy: the arithmetic runs in out's dtype); lse, block_lse [B, H, S]. `lse` is overwritten
    too when it is in out's dtype (else a widened copy takes the result). out and lse may be
    views (rows of a larger accumulator). Returns (out, lse). Two passes over out and one
    over block_out, and no [B, H, S, D] temporary: the per-row weights are [B, H, S]."""
    _check(out, lse, block_out, block_lse)
    if out.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"merge_ accumulates in place into a float32/float64 `out`, got {out.dtype}; use merge()")
    acc = out.dtype
    lse, block_lse = lse.to(acc), block_lse.to(acc)  # lse: itself when already in acc
    new_lse = torch.logaddexp(lse, block_lse)  # [B, H, S]; -inf only if both are -inf
    # Where both sets are empty new_lse is -inf and exp(-inf - -inf) would be NaN; any
    # finite stand-in makes both weights exp(-inf) = 0, so out stays 0.
    ref = new_lse.masked_fill(torch.isneginf(new_lse), 0.0)
    w_old = torch.exp(lse - ref).unsqueeze(-1)  # [B, H, S, 1] broadcast along D
    w_new = torch.exp(block_lse - ref).unsqueeze(-1)  # [B, H, S, 1]
    out.mul_(w_old).addcmul_(block_out, w_new)  # out = w_old·out + w_new·block_out, in place
    return out, lse.copy_(new_lse)


def merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets; the inputs are untouched.

    out, block_out: [B, H, S, D]; lse, block_lse: [B, H, S] (natural log).
    Returns (out, lse) computed in float32 (float64 if any input is float64); the caller
    casts `out` to the activation dtype once, after the last merge, so rounding happens
    once and not per merged block. The result is the one [B, H, S, D] allocation
    (`merge_` into copies of `out` and `lse`).
    """
    _check(out, lse, block_out, block_lse)
    acc = _acc_dtype(out, lse, block_out, block_lse)
    return merge_(out.to(acc, copy=True), lse.to(acc, copy=True), block_out, block_lse)
