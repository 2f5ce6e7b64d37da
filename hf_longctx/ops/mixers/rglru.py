"""The RG-LRU linear recurrence (RecurrentGemma / Griffin) under sequence parallelism: state passing.

Where it sits: called by the RecurrentGemma wrapper of `integrations/mixers/` after the
module's projections, halo convolution and per-token gates (all on the shard); the output
returns to the module's gating and output projection.
h_t = a_t ⊙ h_{t-1} + x_t is diagonal and affine in its incoming state (Griffin §2.4): each
run is computed from zero state (h⁰_t, cumulative decay A_t), one all-gather of two [B, W]
summaries per run, then every rank walks the runs in GLOBAL order and corrects its own:
h_t = h⁰_t + A_t ⊙ h_in (zero at a document start). Exact; no state kept on the module;
fp32 accumulation, as transformers' `_rnn_scan`."""

from __future__ import annotations

import torch

from hf_longctx.ops.mixers.exchange import all_to_all_v
from hf_longctx.ops.mixers.layout import SequenceLayout


def _local_scan(x: torch.Tensor, a: torch.Tensor, starts: list[int]) -> torch.Tensor:
    """h⁰ [B, S_local, W]: the recurrence restarted from zero at every local run start."""
    is_start = set(starts)  # host-side: the loop's branch never reads a tensor
    h = torch.zeros_like(x[:, 0])
    out = []
    for t in range(x.shape[1]):  # a token loop, as transformers' own linear-mode scan
        h = x[:, t] if t in is_start else a[:, t] * h + x[:, t]
        out.append(h)
    return torch.stack(out, dim=1)


def rglru_scan_sequence_parallel(x: torch.Tensor, a: torch.Tensor, lay: SequenceLayout, rank: int, group) -> torch.Tensor:
    """x, a [B, S_local, W] (a already 0 at document starts) → h [B, S_local, W] in fp32, equal
    to running h_t = a_t·h_{t-1} + x_t over every whole document from zero state."""
    x, a = x.float(), a.float()
    b, _, w = x.shape
    runs = lay.runs[rank]
    offsets = [0]
    for r in runs:
        offsets.append(offsets[-1] + r.length)
    h0 = _local_scan(x, a, offsets[:-1])  # [B, S_local, W]
    decay = torch.cat([torch.cumprod(a[:, lo:hi], dim=1) for lo, hi in zip(offsets[:-1], offsets[1:])], dim=1)  # [B, S_local, W]
    ends = lay.on_device(("rglru_ends", rank), x.device, lambda: torch.tensor([hi - 1 for hi in offsets[1:]]))  # [n_runs]
    summary = torch.stack([decay[:, ends], h0[:, ends]], dim=0)  # [2, B, n_runs, W]: (A_end, h⁰_end) per run
    if lay.sp > 1:
        shapes = [(2, b, len(lay.runs[q]), w) for q in range(lay.sp)]
        gathered = all_to_all_v([summary] * lay.sp, shapes, group)  # [2, B, n_runs_q, W] from every rank q
    else:
        gathered = [summary]
    # Exclusive prefix over the runs of the whole sequence, in global order (runs tile [0, S)).
    order = sorted((r.start, q, i) for q, rs in enumerate(lay.runs) for i, r in enumerate(rs))
    cu = set(lay.cu_seqlens)
    state = None  # true state at the end of the previous run
    incoming = {}
    for start, q, i in order:
        h_in = None if (start in cu or state is None) else state  # documents start from zero state
        if q == rank:
            incoming[i] = h_in
        a_end, h_end = gathered[q][0][:, i], gathered[q][1][:, i]  # [B, W]
        state = h_end if h_in is None else h_end + a_end * h_in
    pieces = []
    for i, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
        h_in = incoming[i]
        piece = h0[:, lo:hi]
        pieces.append(piece if h_in is None else piece + decay[:, lo:hi] * h_in[:, None])
    out = torch.cat(pieces, dim=1)  # [B, S_local, W] fp32
    if lay.sp > 1:
        # The backward of the exchange above is a collective too, so every rank must run it. A
        # rank whose runs all start documents (or the first rank of a contiguous layout) uses
        # none of `gathered`, and autograd would prune the node there: the other ranks then
        # hang or mismatch in it. A zero term keeps it in every rank's graph (its gradient is 0;
        # the summaries are finite: decays in [0, 1]).
        out = out + sum(g.sum() for g in gathered) * 0.0
    return out
