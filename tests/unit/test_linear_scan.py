"""One kernel call per linear-mixer layer, and the RG-LRU scan without a token loop, one process.

- `ops/mixers/linear_scan.py` against the sequential recurrence h_t = a_t·h_{t-1} + x_t with
  segment restarts and zero decays inside segments: float64 forward and gradients to 1e-12;
- `rglru_scan_sequence_parallel` (SP = 1, packed documents) against the token loop in fp32
  (1e-5 relative: only the order of the additions differs);
- `ops/mixers/ragged.py`: padded rows round-trip, padding bounded by PAD_LIMIT;
- the head scheme's GDN / Mamba-2 core called ONCE per layer on transformers' torch fallback
  (the documents as padded rows), exact against one call per document.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_longctx.ops.mixers.layout import SequenceLayout
from hf_longctx.ops.mixers.linear_scan import linear_scan
from hf_longctx.ops.mixers.ragged import PAD_LIMIT, PaddedSpans, groups


def _sequential(x, a, starts):
    h, out = None, []
    for t in range(x.shape[1]):
        h = x[:, t] if t in starts else a[:, t] * h + x[:, t]
        out.append(h)
    return torch.stack(out, 1)


def _positions(s, starts):
    pos, p = [], 0
    for t in range(s):
        p = 0 if t in starts else p + 1
        pos.append(p)
    return torch.tensor(pos)


def test_scan_matches_the_recurrence_and_its_gradient():
    g = torch.Generator().manual_seed(0)
    s, starts = 45, {0, 5, 6, 20, 44}
    x = torch.randn(2, s, 3, generator=g, dtype=torch.float64, requires_grad=True)
    a = torch.rand(2, s, 3, generator=g, dtype=torch.float64)
    a[:, 10] = 0.0  # a document start inside a segment
    a.requires_grad_()
    ref, got = _sequential(x, a, starts), linear_scan(x, a, _positions(s, starts))
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    probe = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    for r, q in zip(torch.autograd.grad((ref * probe).sum(), (x, a)), torch.autograd.grad((got * probe).sum(), (x, a))):
        torch.testing.assert_close(q, r, rtol=1e-12, atol=1e-12)


def test_rglru_core_without_sp_matches_the_token_loop():
    from hf_longctx.ops.mixers.rglru import rglru_scan_sequence_parallel

    g = torch.Generator().manual_seed(1)
    cu = (0, 7, 8, 30, 40)
    x = torch.randn(2, 40, 4, generator=g, requires_grad=True)
    a = torch.rand(2, 40, 4, generator=g)
    a[:, list(cu[:-1])] = 0.0  # the gates zero a at document starts
    a.requires_grad_()
    got = rglru_scan_sequence_parallel(x, a, SequenceLayout(cu, 1, 1), 0, None)
    ref = _sequential(x, a, set(cu[:-1]))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    probe = torch.randn(ref.shape, generator=g)
    for r, q in zip(torch.autograd.grad((ref * probe).sum(), (x, a)), torch.autograd.grad((got * probe).sum(), (x, a))):
        torch.testing.assert_close(q, r, rtol=1e-4, atol=1e-5)


def test_padded_rows_round_trip_and_bounded_padding():
    lengths = [50, 3, 7, 4, 30, 1]
    for members in [groups(lengths)]:
        for m in members:
            assert len(m) * max(lengths[i] for i in m) <= PAD_LIMIT * sum(lengths[i] for i in m) or len(m) == 1
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    spans = list(zip(cu[:-1], cu[1:]))
    pads = PaddedSpans.build(spans, cu[-1])
    x = torch.randn(2, cu[-1], 3)
    rows = pads.pad(x)
    assert sum(r.shape[0] * r.shape[1] for r in rows) <= PAD_LIMIT * 2 * cu[-1]
    torch.testing.assert_close(pads.unpad(rows, 2), x, rtol=0, atol=0)


def _count(fn):
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return counted, calls


def test_head_scheme_calls_the_torch_core_once_per_layer():
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    from hf_longctx.ops.mixers.gdn import _documents_core
    from hf_longctx.ops.mixers.mamba2 import mamba2_sequence_parallel, Mamba2Heads

    g = torch.Generator().manual_seed(2)
    cu = (0, 20, 32, 56, 64)  # lengths 20, 12, 24, 8: one padded call (96 <= 2 x 64 tokens)
    lay = SequenceLayout(cu, 1, 1)
    q, k = (F.normalize(torch.randn(1, 64, 2, 8, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(1, 64, 2, 8, generator=g)
    gate, beta = -torch.rand(1, 64, 2, generator=g), torch.rand(1, 64, 2, generator=g)
    core, calls = _count(torch_chunk_gated_delta_rule)
    got = _documents_core(core, q, k, v, gate, beta, lay, varlen=False)
    assert len(calls) == 1
    ref = torch.cat([torch_chunk_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g=gate[:, a:b], beta=beta[:, a:b],
                                                  use_qk_l2norm_in_kernel=True)[0] for a, b in zip(cu[:-1], cu[1:])], 1)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)

    heads = Mamba2Heads.split(4, 2, 1)
    xbc, dt = torch.randn(1, 64, 4 * 3 + 2 * 2 * 5, generator=g), torch.randn(1, 64, 4, generator=g)
    params = dict(conv_weight=torch.randn(32, 4, generator=g), conv_bias=None, activation=F.silu,
                  A_log=torch.randn(4, generator=g), D=torch.randn(4, generator=g), dt_bias=torch.randn(4, generator=g),
                  dt_limit=(0.0, float("inf")), head_dim=3, state=5, chunk_size=8, heads=heads, lay=lay, rank=0, group=None)
    scan, calls = _count(mamba2_chunk_scan)
    got = mamba2_sequence_parallel(xbc, dt, scan=scan, **params)
    assert len(calls) == 1
    ref = torch.cat([mamba2_sequence_parallel(xbc[:, a:b], dt[:, a:b], scan=mamba2_chunk_scan,
                                              **dict(params, lay=SequenceLayout((0, b - a), 1, 1))) for a, b in zip(cu[:-1], cu[1:])], 1)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
