"""The RG-LRU linear recurrence (RecurrentGemma / Griffin) under sequence parallelism: state passing.

Where it sits: called by the RecurrentGemma wrapper of `integrations/mixers/` after the
module's projections, halo convolution and per-token gates (all on the shard); the output
returns to the module's gating and output projection.
h_t = a_t ⊙ h_{t-1} + x_t is diagonal and affine in its incoming state (Griffin §2.4): every
local run is scanned from zero state (h⁰_t and the cumulative decay A_t, one vectorised scan,
`linear_scan.py`), one all-gather of two [B, W] summaries per run, a second scan over the runs
of the whole sequence in GLOBAL order gives each run's incoming state, and every rank corrects
its own: h_t = h⁰_t + A_t ⊙ h_in (zero at a document start). Exact; no state kept on the
module; fp32 accumulation, as transformers' `_rnn_scan`; no loop over tokens or runs."""

from __future__ import annotations

import torch

from hf_longctx.ops.mixers.exchange import all_to_all_v
from hf_longctx.ops.mixers.layout import SequenceLayout
from hf_longctx.ops.mixers.linear_scan import flip_positions, linear_scan


def _offsets(pieces: list[int]) -> list[int]:
    out = [0]
    for n in pieces:
        out.append(out[-1] + n)
    return out


def _plan(lay: SequenceLayout, rank: int) -> dict:
    """Host index tensors of the scans (built once per layout and rank, `SequenceLayout.on_device`)."""
    lengths = [r.length for r in lay.runs[rank]]
    offsets = _offsets(lengths)
    pos = torch.cat([torch.arange(n) for n in lengths])  # [S_local]: offset from the run start
    run_of = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])  # [S_local]: run of each token
    ends = torch.tensor([hi - 1 for hi in offsets[1:]])  # [n_runs]: last token of each run
    order = sorted((r.start, q, i) for q, rs in enumerate(lay.runs) for i, r in enumerate(rs))  # runs in global order
    base = _offsets([len(rs) for rs in lay.runs])  # run (q, i) is row base[q] + i of the gathered summaries
    cu = set(lay.cu_seqlens)
    glob = torch.tensor([base[q] + i for _, q, i in order])  # [N]: gathered row of the k-th run in global order
    doc_pos, prev = [], 0
    for k, (start, _, _) in enumerate(order):
        prev = 0 if start in cu else prev + 1
        doc_pos.append(prev)
    doc_pos = torch.tensor(doc_pos)  # [N]: runs since the document's first run (0 = it starts a document)
    rank_of = {(q, i): k for k, (_, q, i) in enumerate(order)}
    mine = torch.tensor([rank_of[(rank, i)] for i in range(len(lengths))])  # [n_runs]: global order of my runs
    return {"pos": pos, "rpos": flip_positions(pos), "run_of": run_of, "ends": ends, "glob": glob,
            "doc_pos": doc_pos, "doc_rpos": flip_positions(doc_pos), "mine": mine}


def rglru_scan_sequence_parallel(x: torch.Tensor, a: torch.Tensor, lay: SequenceLayout, rank: int, group) -> torch.Tensor:
    """x, a [B, S_local, W] (a already 0 at document starts) → h [B, S_local, W] in fp32, equal
    to running h_t = a_t·h_{t-1} + x_t over every whole document from zero state."""
    x, a = x.float(), a.float()
    b, _, w = x.shape
    p = lay.on_device(("rglru_plan", rank), x.device, lambda: _plan(lay, rank))
    start = (p["pos"] == 0)[None, :, None].to(a.dtype)  # [1, S_local, 1]: run starts
    # one scan over [x | a at run starts] with a twice: h⁰ (zero state per run) and A_t = Π a from the run start
    both = linear_scan(torch.cat([x, a * start], -1), torch.cat([a, a], -1), p["pos"], p["rpos"])  # [B, S_local, 2W]
    h0, decay = both[..., :w], both[..., w:]
    summary = torch.stack([decay.index_select(1, p["ends"]), h0.index_select(1, p["ends"])])  # [2, B, n_runs, W]
    if lay.sp > 1:
        shapes = [(2, b, len(lay.runs[q]), w) for q in range(lay.sp)]
        gathered = all_to_all_v([summary] * lay.sp, shapes, group)  # [2, B, n_runs_q, W] from every rank q
        every = torch.cat(gathered, dim=2)  # [2, B, N, W] rank by rank
    else:
        every = summary
    ordered = every.index_select(2, p["glob"])  # [2, B, N, W]: runs in global order
    # state at the end of run k = A_end,k · state_{k-1} + h⁰_end,k, from zero at a document's first run
    state = linear_scan(ordered[1], ordered[0], p["doc_pos"], p["doc_rpos"])  # [B, N, W]
    incoming = torch.cat([state.new_zeros(b, 1, w), state[:, :-1]], 1)  # [B, N, W]: the state before run k
    incoming = incoming * (p["doc_pos"] > 0)[None, :, None]  # zero where run k starts a document
    h_in = incoming.index_select(1, p["mine"]).index_select(1, p["run_of"])  # [B, S_local, W]
    return torch.addcmul(h0, decay, h_in)  # h_t = h⁰_t + A_t ⊙ h_in; [B, S_local, W] fp32
