"""The documents (or runs) of a packed row as the rows of one zero-padded batch: one kernel call.

Where it sits: the linear mixers' cores (`gdn.py`, `mamba2.py`: the head all-to-all;
`gdn_state.py`, `mamba2_state.py`: state passing) run their chunked kernel ONCE per layer.
A kernel that keeps sequences apart itself takes the packed row and its boundaries
(flash-linear-attention's `cu_seqlens`, mamba_ssm's `seq_idx`); transformers' torch
fallbacks refuse those, so there the spans become the rows of one batch [n, L_max, ...]
(`PaddedSpans`), zero-padded at their ends. Exact for causal recurrences: a real token never
reads a later position, and the zero inputs the cores pass (log-decay 0 or Δ = 0, no write)
leave a span's final state as it is. Spans are grouped so that no group pads to more than
`PAD_LIMIT` times its tokens (one group, one call, unless the lengths are very uneven).
Index tensors are built once per layout (`SequenceLayout.on_device`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

PAD_LIMIT = 2.0  # padded tokens <= PAD_LIMIT x real tokens per group: bounded waste, few calls


def groups(lengths: Sequence[int]) -> list[list[int]]:
    """Span indices per kernel call: longest first, a span joins the open group while the
    group's padded size (count x its longest) stays within PAD_LIMIT x its tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    tokens = longest = 0
    for i in order:
        n = lengths[i]
        if out and (len(out[-1]) + 1) * longest <= PAD_LIMIT * (tokens + n):
            out[-1].append(i)
            tokens += n
            continue
        out.append([i])
        tokens, longest = n, max(n, 1)
    return out


@dataclass(frozen=True)
class PaddedSpans:
    """Spans [lo, hi) of dim 1 of a [B, S, ...] tensor as padded rows, per call group.

    gathers[c]: int64 [n_c · L_c], rows of [S + 1] (S: an appended zero row) in call c's layout;
    scatter: int64 [Σ lengths], where each real token (spans in order) sits in the
    concatenation of the calls' flattened outputs [B, Σ n_c · L_c, ...]."""

    spans: tuple
    rows: tuple  # per call: (span indices, L_c)
    gathers: tuple
    scatter: torch.Tensor
    members: tuple  # per call: int64 [n_c], its span indices as a tensor (per-span tensors -> rows)

    @staticmethod
    def build(spans: Sequence[tuple[int, int]], total: int) -> "PaddedSpans":
        lengths = [hi - lo for lo, hi in spans]
        calls, gathers, where, base = [], [], {}, 0
        for members in groups(lengths):
            width = max(1, max(lengths[i] for i in members))
            rows = []  # per member: its positions, then the zero row S up to L_c
            for r, i in enumerate(members):
                lo, hi = spans[i]
                rows += [torch.arange(lo, hi), torch.full((width - (hi - lo),), total, dtype=torch.long)]
                where[i] = torch.arange(base + r * width, base + r * width + hi - lo)
            calls.append((tuple(members), width))
            gathers.append(torch.cat(rows))  # [n_c · L_c]
            base += len(members) * width
        scatter = torch.cat([where[i] for i in range(len(spans))]) if spans else torch.empty(0, dtype=torch.long)
        members = tuple(torch.tensor(m, dtype=torch.long) for m, _ in calls)
        return PaddedSpans(tuple(spans), tuple(calls), tuple(gathers), scatter, members)

    def to(self, device) -> "PaddedSpans":
        from hf_longctx.devices import to_device

        return PaddedSpans(self.spans, self.rows, tuple(to_device(list(self.gathers), device)),
                           to_device(self.scatter, device), tuple(to_device(list(self.members), device)))

    def pad(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [B, S, ...] -> per call [B · n_c, L_c, ...], zero past each span's end."""
        b = x.shape[0]
        ext = torch.cat([x, x.new_zeros(b, 1, *x.shape[2:])], dim=1)  # [B, S + 1, ...]: row S is zero
        out = []
        for (members, width), idx in zip(self.rows, self.gathers):
            picked = ext.index_select(1, idx)  # [B, n_c · L_c, ...]
            out.append(picked.reshape(b * len(members), width, *x.shape[2:]))  # [B · n_c, L_c, ...]
        return out

    def unpad(self, ys: Sequence[torch.Tensor], b: int) -> torch.Tensor:
        """Per call [B · n_c, L_c, ...] -> [B, Σ lengths, ...] (the spans' tokens in order)."""
        flat = [y.reshape(b, -1, *y.shape[2:]) for y in ys]  # [B, n_c · L_c, ...]
        cat = flat[0] if len(flat) == 1 else torch.cat(flat, dim=1)
        return cat.index_select(1, self.scatter)

    def rows_of(self, per_span: torch.Tensor, b: int) -> list[torch.Tensor]:
        """[n_spans, B, ...] (one tensor per span, e.g. an initial state) -> per call [B · n_c, ...]."""
        out = []
        for (members, _), idx in zip(self.rows, self.members):
            picked = per_span.index_select(0, idx)  # [n_c, B, ...]
            out.append(picked.transpose(0, 1).reshape(b * len(members), *per_span.shape[2:]))  # row b·n_c + r
        return out

    def per_span(self, per_row: Sequence[torch.Tensor], b: int) -> list[torch.Tensor]:
        """Per call [B · n_c, ...] (a per-row result, e.g. a final state) -> per span [B, ...], spans in order."""
        out: list = [None] * len(self.spans)
        for (members, _), t in zip(self.rows, per_row):
            t = t.reshape(b, len(members), *t.shape[1:])  # [B, n_c, ...]
            for r, i in enumerate(members):
                out[i] = t[:, r]
        return out


def padded_spans(lay, key, spans: Sequence[tuple[int, int]], total: int, device) -> PaddedSpans:
    """The `PaddedSpans` of `spans` (of a [B, total, ...] tensor) on `device`, built once per
    layout (`SequenceLayout.memo`): every layer of the batch reuses the device index tensors."""
    spans = tuple(spans)
    return lay.memo(("padded", key, spans, total, str(device)), lambda: PaddedSpans.build(spans, total).to(device))
