"""ops/lse.merge: exact online-softmax merge over disjoint key sets (float64 against dense math)."""

import pytest
import torch

from hf_longctx.ops.lse import merge, merge_

# float64 inputs keep the merge in float64: the only error left is a few roundings of
# exp/log, so 1e-12 is ~1e4 ulps of headroom yet fails on any wrong weight.
TOL = dict(rtol=1e-12, atol=1e-12)


def _partial(q, k, v, keep):
    """Dense attention of q over the keys where keep [Sq, Sk] is True: (out, lse), lse -inf for empty rows."""
    s = (q @ k.transpose(-1, -2)).masked_fill(~keep, float("-inf"))  # [B, H, Sq, Sk]
    lse = torch.logsumexp(s, -1)  # [B, H, Sq]
    p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1))
    return p @ v, lse


def _qkv(sq=7, sk=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, n, 4, generator=g, dtype=torch.float64) for n in (sq, sk, sk)]


def test_two_halves_equal_all_keys():
    q, k, v = _qkv()
    everything = torch.ones(7, 11, dtype=torch.bool)
    split = torch.rand(7, 11, generator=torch.Generator().manual_seed(1)) < 0.5
    split[0] = True  # row 0: every key in the first set, second set empty (lse -inf)
    split[1] = False  # row 1: the reverse
    o1, l1 = _partial(q, k, v, split)
    o2, l2 = _partial(q, k, v, ~split)
    out, lse = merge(o1, l1, o2, l2)
    ref_out, ref_lse = _partial(q, k, v, everything)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)


def test_both_empty_gives_zero_and_neg_inf_without_nan():
    q, k, v = _qkv()
    keep = torch.ones(7, 11, dtype=torch.bool)
    keep[3] = False  # row 3 has no key in either set
    o1, l1 = _partial(q, k, v, keep & (torch.arange(11) < 5))
    o2, l2 = _partial(q, k, v, keep & (torch.arange(11) >= 5))
    out, lse = merge(o1, l1, o2, l2)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.isneginf(lse[:, :, 3]).all()
    assert (out[:, :, 3] == 0).all()
    ref_out, ref_lse = _partial(q, k, v, keep)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)


def test_merge_into_empty_accumulator_is_identity():
    q, k, v = _qkv()
    o, l = _partial(q, k, v, torch.ones(7, 11, dtype=torch.bool))
    out, lse = merge(torch.zeros_like(o), torch.full_like(l, float("-inf")), o, l)
    torch.testing.assert_close(out, o, **TOL)
    torch.testing.assert_close(lse, l, **TOL)


def test_associative_and_commutative():
    q, k, v = _qkv(sk=12)
    sets = [(torch.arange(12) % 3 == r).expand(7, 12) for r in range(3)]
    a, b, c = (_partial(q, k, v, s) for s in sets)
    left = merge(*merge(*a, *b), *c)
    right = merge(*a, *merge(*b, *c))
    swapped = merge(*c, *merge(*b, *a))
    for x in (right, swapped):
        torch.testing.assert_close(left[0], x[0], **TOL)
        torch.testing.assert_close(left[1], x[1], **TOL)
    ref = _partial(q, k, v, torch.ones(7, 12, dtype=torch.bool))
    torch.testing.assert_close(left[0], ref[0], **TOL)


def test_low_precision_inputs_merge_in_float32():
    q, k, v = _qkv()
    o1, l1 = _partial(q, k, v, (torch.arange(11) < 4).expand(7, 11))
    o2, l2 = _partial(q, k, v, (torch.arange(11) >= 4).expand(7, 11))
    out, lse = merge(o1.bfloat16(), l1.float(), o2.bfloat16(), l2.float())
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    ref = _partial(q, k, v, torch.ones(7, 11, dtype=torch.bool))
    # inputs rounded to bf16 (8 mantissa bits, rel. 2^-8 = 3.9e-3); the merge adds only fp32 error
    torch.testing.assert_close(out, ref[0].float(), rtol=0, atol=4e-3 * ref[0].abs().max().item())
    torch.testing.assert_close(lse, ref[1].float(), rtol=1e-6, atol=1e-6)


def test_shape_mismatch_raises():
    o = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="block_out"):
        merge(o, torch.zeros(1, 2, 3), torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5))


def test_merge_in_place_equals_merge_and_reads_a_bf16_block_as_is():
    """`merge_` folds a block into the caller's float32 accumulator in place; a bf16 block is
    read as it is (bf16 -> float32 is exact, so the result equals merging its widened copy)."""
    g = torch.Generator().manual_seed(3)
    acc = torch.randn(2, 3, 5, 4, generator=g)
    block = torch.randn(2, 3, 5, 4, generator=g).to(torch.bfloat16)
    lse, block_lse = torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g)
    lse[0, 0, 0] = block_lse[0, 0, 1] = float("-inf")
    ref_out, ref_lse = merge(acc, lse, block.float(), block_lse)
    same = acc.clone()
    out, new_lse = merge_(same, lse, block, block_lse)
    assert out is same  # the accumulator itself
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    assert torch.equal(new_lse, ref_lse)
    with pytest.raises(ValueError, match="float32/float64"):
        merge_(block.clone(), lse, block, block_lse)


def test_merge_has_no_full_size_temporaries():
    from benchmarks.hot_path import merge_costs

    costs = merge_costs((1, 2, 64, 8))
    before = costs["before: block widened, w_old·out + w_new·block"]
    assert costs["merge_ (in place into the accumulator)"] == (0, 5) and before == (3, 9)
    assert costs["merge (fresh result)"][0] == 0
