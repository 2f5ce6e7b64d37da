"""Single-process dense reference attention for every attention test.

Where it sits: outside the library. Ring, Ulysses, USP and FPDT tests gather their
outputs and gradients back to global order and compare with `reference_attention`, run
on the whole packed sequence in one process. It implements the mask rule of the design
(same document, causal, sliding window as transformers' `kv_idx > q_idx - window`,
Gemma2 softcap) with plain dense math and plain autograd, so it shares no code with
`hf_longctx.ops`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hf_longctx.layout import Run


def _doc_ids(cu_seqlens: Sequence[int] | torch.Tensor | None, b: int, s: int, device) -> torch.Tensor:
    """[B, S] document id of every token; None = every row of the batch is one document."""
    if cu_seqlens is None:
        return torch.zeros(b, s, dtype=torch.long, device=device)
    cu = [int(x) for x in cu_seqlens]
    if b != 1 or cu[0] != 0 or cu[-1] != s or any(y <= x for x, y in zip(cu[:-1], cu[1:])):
        raise ValueError(f"cu_seqlens must be strictly increasing from 0 to S={s} with B == 1, got B={b}, cu_seqlens={cu}")
    lengths = torch.tensor([y - x for x, y in zip(cu[:-1], cu[1:])], device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)[None]  # [1, S]


def reference_mask(
    cu_seqlens: Sequence[int] | torch.Tensor | None, b: int, s: int, *, causal: bool, window: int | None, device=None
) -> torch.Tensor:
    """bool [B, S, S], True = query i may attend key j (global positions)."""
    doc = _doc_ids(cu_seqlens, b, s, device)
    pos = torch.arange(s, device=device)
    diff = pos[:, None] - pos[None, :]  # [S, S]: i - j
    allowed = doc[:, :, None] == doc[:, None, :]  # [B, S, S]
    if causal:
        allowed = allowed & (diff >= 0)
    if window is not None:
        allowed = allowed & ((diff < window) if causal else (diff.abs() < window))
    return allowed


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Sequence[int] | torch.Tensor | None = None, *,
    causal: bool = True, scale: float | None = None, window: int | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense attention in the PUBLIC layout: q [B, S, H, D], k/v [B, S, H_kv, D] -> [B, S, H, D].

    Computed in the input dtype (tests pass float64). Rows with no allowed key give 0.
    `sinks` [H]: attention sinks as HF's eager GPT-OSS attention applies them -- one extra
    logit column per head, softmaxed with the scores and dropped (it has no value).
    """
    b, s, h, d = q.shape
    hkv = k.shape[2]
    if k.shape != v.shape or k.shape[:2] != (b, s) or k.shape[3] != d or h % hkv:
        raise ValueError(f"k/v must be [B={b}, S={s}, H_kv, D={d}] with H={h} divisible by H_kv, got {tuple(k.shape)}, {tuple(v.shape)}")
    scale = d**-0.5 if scale is None else scale
    qh = q.transpose(1, 2)  # [B, H, S, D]
    kh = k.transpose(1, 2).repeat_interleave(h // hkv, dim=1)  # [B, H, S, D]
    vh = v.transpose(1, 2).repeat_interleave(h // hkv, dim=1)  # [B, H, S, D]
    scores = qh @ kh.transpose(-1, -2) * scale  # [B, H, S, S]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    allowed = reference_mask(cu_seqlens, b, s, causal=causal, window=window, device=q.device)[:, None]  # [B, 1, S, S]
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink_col = sinks.to(scores.dtype).reshape(1, h, 1, 1).expand(b, h, s, 1)  # [B, H, S, 1]
        probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]  # drop the sink column
        return (probs @ vh).transpose(1, 2)  # [B, S, H, D]; a row with no key puts all weight on the sink: 0
    # softmax of an all -inf row is NaN; those rows have no key and must give 0.
    probs = torch.softmax(scores.masked_fill(~allowed.any(-1, keepdim=True), 0.0), dim=-1) * allowed
    return (probs @ vh).transpose(1, 2)  # [B, S, H, D]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b|, in float64."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def make_runs(cu_seqlens: Sequence[int] | torch.Tensor) -> list[Run]:
    """Runs of the whole packed sequence: one per document."""
    cu = [int(x) for x in cu_seqlens]
    return [Run(i, a, b - a) for i, (a, b) in enumerate(zip(cu[:-1], cu[1:]))]


def random_runs(cu_seqlens: Sequence[int], rng) -> list[Run]:
    """The whole packed sequence cut into random pieces at random points, pieces shuffled
    (`rng`: a `random.Random`)."""
    runs = []
    for doc, (a, b) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        cuts = sorted({a, b, *(rng.randrange(a, b) for _ in range(2))})
        runs += [Run(doc, x, y - x) for x, y in zip(cuts[:-1], cuts[1:])]
    rng.shuffle(runs)
    return runs
