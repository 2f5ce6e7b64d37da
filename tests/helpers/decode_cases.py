"""What the decode-attention tests share: the SP layouts they cover, shard_batch's padded
boundaries for packed prompts, and the single-process reference of one decode step.

`LAYOUTS` are (ulysses, ring, fpdt_chunks) of SP groups of 1, 2 and 4 ranks: Ulysses, ring, U×R
and FPDT pieces. `padded_cu` pads every prompt to the ring's document multiple at its end and the
row to the layout's sequence multiple with a trailing padding document, as `shard_batch` does.
`reference_step` is softmax attention in float64 of each row's query over that row's keys at
positions <= its own (and within the window), GQA by HF's rule, softcap and sinks as HF's eager
attention applies them.
"""

from __future__ import annotations

import torch

from hf_longctx import layout

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (4, 1, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2), (4, 1, 2)]


def padded_cu(lengths: list[int], ring: int, ulysses: int, fpdt_chunks: int) -> list[int]:
    dm, sm = layout.doc_multiple(ring), layout.seq_multiple(ring, ulysses, fpdt_chunks)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n + (-n) % dm)
    if cu[-1] % sm:
        cu.append(cu[-1] + (-cu[-1]) % sm)  # the padding document
    return cu


def rank_indices(cu: list[int], ulysses: int, ring: int, fpdt_chunks: int) -> list[torch.Tensor]:
    """[SP] x int64 [S_local]: the global positions of each SP rank (sp_rank = ring_rank * U + ulysses_rank)."""
    return [layout.local_indices(cu, ring=ring, ulysses=ulysses, ring_rank=r // ulysses, ulysses_rank=r % ulysses,
                                 fpdt_chunks=fpdt_chunks) for r in range(ring * ulysses)]


def reference_step(q, keys, values, lengths, step, *, scale, window=None, softcap=None, sinks=None):
    """out [N, H, D] float64 of each row's new query (position P_n + step) over its keys.

    q [N, H, D]; keys/values: per row [P_n + step + 1, H_kv, D] (positions 0 .. P_n + step)."""
    outs = []
    for n, (k, v) in enumerate(zip(keys, values)):
        h, h_kv = q.shape[1], k.shape[1]
        pos = lengths[n] + step
        kk = k.double().repeat_interleave(h // h_kv, dim=1)  # [L, H, D]
        vv = v.double().repeat_interleave(h // h_kv, dim=1)
        s = torch.einsum("hd,lhd->hl", q[n].double(), kk) * scale  # [H, L]
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        j = torch.arange(k.shape[0])
        seen = (j <= pos) & ((pos - j < window) if window is not None else True)
        s = s.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None]], dim=1)  # one virtual key of value zero per head
            vv = torch.cat([vv, torch.zeros_like(vv[:1])], dim=0)
        p = torch.softmax(s, dim=-1)
        outs.append(torch.einsum("hl,lhd->hd", p, vv))
    return torch.stack(outs)
