"""Tile-by-tile driver: one kernel call per planned tile, tiles folded by the LSE merge.

Where it sits: the backends whose kernel takes one dense tile with an optional boolean
mask -- "aten_cpu" (the aten CPU flash op, `aten_cpu.py`) and "math" (`ops/math_kernel.py`,
the last resort on any device). `ops/kernels.py` hands it the blocks of `ops/blocks.py`
(full / causal / masked tiles of the same document); masked tiles get the exact boolean
mask of `block_mask`. Tiles are computed in float32 and fold with `ops/lse.merge_` (Milakov &
Gimelshein 2018) into the first tile of their rows, or into the caller's accumulators
(`into`); backward pieces of one row range are summed in float32, or added in place into
the caller's float32 sums.

Layout: q [B, H, Sq, D], k/v [B, H_kv, Sk, D]; out [B, H, Sq, D], lse [B, H, Sq].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from hf_longctx.ops.backends.aten_cpu import expand_kv, reduce_kv
from hf_longctx.ops.blocks import Block, block_mask
from hf_longctx.ops.lse import merge_
from hf_longctx.ops.math_kernel import NEG_INF, acc_dtype


def _assemble(
    pieces: dict[tuple[int, int], torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype, device, fill: float,
    token_major: bool = False,
) -> torch.Tensor:
    """Disjoint ranges of dim 2 (S) in order, `fill` in the gaps. One allocation written once:
    a zero-filled buffer plus in-place adds would touch every fresh page twice, which costs
    several % of a CPU attention step. `token_major` (an output [B, H, S, D]): the buffer is laid
    out [B, S, H, D] and returned as its [B, H, S, D] view, the layout every backend's output has
    (what the attention function returns is token-major, so no layout copy follows)."""
    if token_major:
        b, h, s, d = shape
        out = torch.empty(b, s, h, d, dtype=dtype, device=device).transpose(1, 2)  # [B, H, S, D] view of [B, S, H, D]
        at = 0
        for (lo, hi), piece in sorted(pieces.items()):
            out[:, :, at:lo].fill_(fill)
            out[:, :, lo:hi].copy_(piece)  # rounds to `dtype` as it writes
            at = hi
        out[:, :, at:].fill_(fill)
        return out
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
    total = pieces[0].to(acc_dtype(pieces[0].dtype))
    for piece in pieces[1:]:
        total = total + piece
    return total


def _masks(blocks: Sequence[Block], causal: bool, window: int | None, device) -> list[torch.Tensor | None]:
    return [block_mask(b, causal=causal, window=window, device=device) if b.kind == "masked" else None for b in blocks]


@dataclass(frozen=True)
class TiledBackend:
    """A per-tile kernel pair behind the (out, lse) contract of `ops/kernels.py`.

    tile_forward(q, k, v, *, scale, causal, mask, softcap, out_dtype) -> (out, lse) and
    tile_backward(dout, q, k, v, out, lse, *, scale, causal, mask, softcap, grad_dtype)
    -> (dq, dk, dv); `expand_gqa`: the kernel wants H_kv = H (expanded once per call)."""

    name: str
    tile_forward: Callable
    tile_backward: Callable
    expand_gqa: bool

    def forward(self, q, k, v, blocks: Sequence[Block], *, scale, causal, window, softcap, out_dtype, widen=True, into=None):
        """`widen` is for the fused kernels (`packed.py`); tiles are computed in `out_dtype`.
        `into=(out, lse)`: the caller's float32 accumulators, every tile merged into its rows
        in place (and returned)."""
        masks = _masks(blocks, causal, window, q.device)
        fwd = dict(scale=scale, softcap=softcap)
        whole = len(blocks) == 1 and blocks[0][:4] == (0, q.shape[2], 0, k.shape[2])
        if whole and into is None:  # one tile: tensors as they are
            return self.tile_forward(q, k, v, causal=blocks[0].kind == "causal", mask=masks[0], out_dtype=out_dtype, **fwd)
        if self.expand_gqa and not whole:  # once per call, not per tile
            k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        outs, lses = {}, {}
        for b, m in zip(blocks, masks):  # tiles of one query run merge into the same rows
            o, l = self.tile_forward(
                q[:, :, b.q_lo:b.q_hi], k[:, :, b.k_lo:b.k_hi], v[:, :, b.k_lo:b.k_hi],
                causal=b.kind == "causal", mask=m, out_dtype=acc_dtype(q.dtype), **fwd,
            )  # o [B, H, nq, D], l [B, H, nq]: fresh, float32
            rows = (b.q_lo, b.q_hi)
            if into is not None:
                merge_(into[0][:, :, b.q_lo:b.q_hi], into[1][:, :, b.q_lo:b.q_hi], o, l)
            elif rows in outs:
                merge_(outs[rows], lses[rows], o, l)
            else:
                outs[rows], lses[rows] = o, l
        if into is not None:
            return into
        return (
            _assemble(outs, q.shape, out_dtype, q.device, 0.0, token_major=True),
            _assemble(lses, q.shape[:3], acc_dtype(q.dtype), q.device, NEG_INF),
        )

    def backward(
        self, dout, q, k, v, out, lse, blocks: Sequence[Block], *, scale, causal, window, softcap, grad_dtype,
        widen=True, into=(None, None, None),
    ):
        """`into`: per gradient (dq, dk, dv) None or the caller's float32 sum, which the tiles
        add into in place (and which is returned); `widen` is for the fused kernels."""
        masks = _masks(blocks, causal, window, q.device)
        bwd = dict(scale=scale, softcap=softcap)
        if len(blocks) == 1 and blocks[0][:4] == (0, q.shape[2], 0, k.shape[2]) and all(t is None for t in into):
            return self.tile_backward(
                dout, q, k, v, out, lse, causal=blocks[0].kind == "causal", mask=masks[0], grad_dtype=grad_dtype, **bwd
            )
        hkv, k_dtype, v_dtype, acc = k.shape[1], k.dtype, v.dtype, acc_dtype(q.dtype)
        if self.expand_gqa:
            k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        dqs, dks, dvs = {}, {}, {}
        for b, m in zip(blocks, masks):
            qs, ks = slice(b.q_lo, b.q_hi), slice(b.k_lo, b.k_hi)
            gq, gk, gv = self.tile_backward(
                dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs], lse[:, :, qs],
                causal=b.kind == "causal", mask=m, grad_dtype=acc, **bwd,
            )  # tiles stay in the accumulation dtype until they are summed
            dqs.setdefault((b.q_lo, b.q_hi), []).append(gq)
            dks.setdefault((b.k_lo, b.k_hi), []).append(gk)
            dvs.setdefault((b.k_lo, b.k_hi), []).append(gv)
        # Sums of tiles and of GQA heads stay in the accumulation dtype: one rounding at the end.
        grads = []
        for pieces, t, total, heads, dtype in ((dqs, q, into[0], q.shape[1], q.dtype), (dks, k, into[1], hkv, k_dtype),
                                               (dvs, v, into[2], hkv, v_dtype)):
            sums = {r: reduce_kv(_summed(p), heads, acc) for r, p in pieces.items()}  # [B, H(_kv), n, D]
            if total is None:
                grads.append(_assemble(sums, (*t.shape[:1], heads, *t.shape[2:]), grad_dtype or dtype, t.device, 0.0))
                continue
            for (lo, hi), g in sums.items():
                total[:, :, lo:hi] += g  # in place into the caller's float32 sum
            grads.append(total)
        return tuple(grads)
