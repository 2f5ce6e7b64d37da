"""The diagonal linear recurrence h_t = a_t ⊙ h_{t-1} + x_t over segments, in ⌈log2 S⌉ vectorised steps.

Where it sits: the RG-LRU core (`rglru.py`, Griffin §2.4) runs it over the local runs of a
shard (from zero state) and over the runs of the whole sequence (the states passed between
ranks), instead of a Python loop over tokens. A Hillis-Steele scan of the associative pairs
(A, h) (Blelloch, "Prefix sums and their applications", 1990: first-order linear recurrences
as a scan): after the step of distance d every element holds the composition of up to 2d
elements ending at it within its segment; a segment starts from zero state. Exact up to the
order of fp32 additions. Backward: the adjoint recurrence runs backward in time,
g_t = dh_t + a_{t+1}·g_{t+1} (within a segment), dx = g, da_t = g_t·h_{t-1}: the same scan on
the flipped sequence; only a and h are saved (no log S intermediates).
Layout: x, a [B, S, W]; `pos` int64 [S]: each position's offset from its segment's start."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _shift(t: torch.Tensor, d: int, fill: float) -> torch.Tensor:
    """t[:, i - d] at i ([B, S, W]); `fill` for i < d."""
    return F.pad(t[:, :-d], (0, 0, d, 0), value=fill)  # [B, S, W]


def scan(x: torch.Tensor, a: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """h [B, S, W] with h_t = a_t·h_{t-1} + x_t, restarted from 0 where pos = 0 (no autograd)."""
    h, A = x, a
    d, s = 1, x.shape[1]
    while d < s:
        same = (pos >= d)[None, :, None]  # [1, S, 1]: t - d lies in t's segment
        h = torch.addcmul(h, A * same, _shift(h, d, 0.0))  # h_t += A_t · h_{t-d}
        if 2 * d < s:  # the last step needs no product
            A = torch.where(same, A * _shift(A, d, 1.0), A)  # A_t = Π a over (t - 2d, t] in the segment
        d *= 2
    return h


def flip_positions(pos: torch.Tensor) -> torch.Tensor:
    """`pos` of the flipped sequence: each position's distance to its segment's end."""
    s = pos.shape[0]
    start = torch.arange(s, device=pos.device) - pos  # [S]: the segment start of every position
    nxt = torch.cat([start[1:], start.new_full((1,), -1)])  # start of position t + 1
    last = nxt != start  # the last position of its segment
    # distance to the end = (index of the segment's last position) - t: a reverse running minimum
    idx = torch.where(last, torch.arange(s, device=pos.device), torch.full_like(pos, s))
    end = torch.flip(torch.cummin(torch.flip(idx, [0]), 0).values, [0])  # [S]
    return torch.flip(end - torch.arange(s, device=pos.device), [0])


class LinearScan(torch.autograd.Function):
    """h = scan(x, a, pos), differentiable in x and a; `rpos` = flip_positions(pos)."""

    @staticmethod
    def forward(ctx, x, a, pos, rpos):
        h = scan(x, a, pos)
        ctx.save_for_backward(a, h, pos, rpos)
        return h

    @staticmethod
    def backward(ctx, dh):
        a, h, pos, rpos = ctx.saved_tensors
        first = (pos == 0)[None, :, None]  # [1, S, 1]
        a_next = F.pad(a[:, 1:], (0, 0, 0, 1)).masked_fill(_next_starts(first), 0.0)  # a_{t+1} in the same segment
        g = torch.flip(scan(torch.flip(dh, [1]), torch.flip(a_next, [1]), rpos), [1])  # [B, S, W]
        h_prev = _shift(h, 1, 0.0).masked_fill(first, 0.0)  # h_{t-1}, 0 at a segment start
        return g, g * h_prev, None, None


def _next_starts(first: torch.Tensor) -> torch.Tensor:
    """[1, S, 1]: position t + 1 starts a segment (or t is the last position)."""
    return torch.cat([first[:, 1:], torch.ones_like(first[:, :1])], dim=1)


def linear_scan(x: torch.Tensor, a: torch.Tensor, pos: torch.Tensor, rpos: torch.Tensor | None = None) -> torch.Tensor:
    """h [B, S, W]: h_t = a_t·h_{t-1} + x_t, from zero state at every segment start (pos = 0)."""
    return LinearScan.apply(x, a, pos, flip_positions(pos) if rpos is None else rpos)
