"""ops/sinks.py: the sink merge and its gradient against HF's eager rule, in float64.

HF's eager GPT-OSS attention appends the sink logit as one extra softmax column and drops
it; `merge_sink` must give the same (out, lse) from the sink-free pair, `sink_grad` the
autograd gradient of that rule, and merging per key piece must NOT equal merging once (so
the distributed tests can tell the two apart). float64 throughout: only a few roundings of
exp/log remain, so 1e-12 is generous yet fails on any wrong weight.
"""

import pytest
import torch

from hf_longctx.ops.lse import merge
from hf_longctx.ops.sinks import check_sinks, merge_sink, sink_grad

TOL = dict(rtol=1e-12, atol=1e-12)


def _dense(q, k, v, keep, sinks=None):
    """(out, lse) of q over the keys where keep [Sq, Sk]; with `sinks` [H] HF's eager rule."""
    s = (q @ k.transpose(-1, -2)).masked_fill(~keep, float("-inf"))  # [B, H, Sq, Sk]
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], -1)  # the sink column
        vz = torch.cat([v, torch.zeros_like(v[:, :, :1])], 2)  # the sink has no value
    else:
        vz = v
    lse = torch.logsumexp(s, -1)  # [B, H, Sq]
    p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1))
    return p @ vz, lse


def _problem(seed=0, sq=6, sk=9):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, n, 4, generator=g, dtype=torch.float64) for n in (sq, sk, sk))
    sinks = torch.randn(3, generator=g, dtype=torch.float64) + 1.0
    keep = torch.rand(sq, sk, generator=g) < 0.7
    keep[2] = False  # a row with no real key: all weight on the sink, out 0
    return q, k, v, sinks, keep


def test_merge_sink_equals_extra_softmax_column():
    q, k, v, sinks, keep = _problem()
    out, lse = merge_sink(*_dense(q, k, v, keep), sinks)
    ref_out, ref_lse = _dense(q, k, v, keep, sinks)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    assert (out[:, :, 2] == 0).all() and torch.equal(lse[:, :, 2], sinks.view(1, 3).expand(2, 3))
    # the sinks matter for this problem: without them the output is far off
    assert (ref_out - _dense(q, k, v, keep)[0]).abs().max() > 0.1


def test_merge_once_after_pieces_is_exact_and_per_piece_is_not():
    q, k, v, sinks, keep = _problem(seed=1)
    halves = [keep & (torch.arange(9) < 4), keep & (torch.arange(9) >= 4)]
    a, b = (_dense(q, k, v, h) for h in halves)
    once = merge_sink(*merge(*a, *b), sinks)
    per_piece = merge(*merge_sink(*a, sinks), *merge_sink(*b, sinks))  # the sink counted twice
    ref = _dense(q, k, v, keep, sinks)
    torch.testing.assert_close(once[0], ref[0], **TOL)
    assert (per_piece[0] - ref[0]).abs().max() > 1e-2


def test_sink_grad_equals_autograd_of_the_eager_rule():
    q, k, v, sinks, keep = _problem(seed=2)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    s = sinks.clone().requires_grad_()
    ref_out, _ = _dense(q, k, v, keep, s)
    ref_out.backward(dout)
    out, lse = merge_sink(*_dense(q, k, v, keep), sinks)
    torch.testing.assert_close(sink_grad(dout, out, lse, sinks), s.grad, **TOL)
    # summing per row piece (FPDT query chunks) gives the same
    parts = sum(sink_grad(dout[:, :, r], out[:, :, r], lse[:, :, r], sinks) for r in (slice(0, 2), slice(2, 6)))
    torch.testing.assert_close(parts, s.grad, **TOL)


def test_low_precision_merge_stays_in_accumulation_dtype():
    q, k, v, sinks, keep = _problem(seed=4)
    o, l = _dense(q, k, v, keep)
    out, lse = merge_sink(o.float(), l.float(), sinks.bfloat16())
    assert out.dtype == lse.dtype == torch.float32
    assert sink_grad(out, out, lse, sinks.bfloat16()).dtype == torch.bfloat16  # returned in the parameter's dtype


def test_minus_inf_sink_and_no_key_gives_zero_not_nan():
    q, k, v, _, keep = _problem(seed=5)
    sinks = torch.tensor([float("-inf"), 0.0, 1.0], dtype=torch.float64)
    out, lse = merge_sink(*_dense(q, k, v, keep), sinks)
    assert not out.isnan().any() and not lse.isnan().any()
    assert not sink_grad(torch.ones_like(out), out, lse, sinks).isnan().any()


@pytest.mark.parametrize("bad", [torch.zeros(4), torch.zeros(3, 1), torch.zeros(3, dtype=torch.long), [0.0, 0.0, 0.0]])
def test_bad_sinks_raise_naming_the_shape(bad):
    with pytest.raises(ValueError, match=r"sinks must be a floating tensor of shape \[H\] = \[3\]"):
        check_sinks(bad, 3)
