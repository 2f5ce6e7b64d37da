"""Decode attention over a sequence-parallel KV cache (`ops/decode_attention.py`, `ops/decode_cache.py`,
`ops/decode_merge.py`) against single-process attention, on every layout, in one process.

Every SP rank of a layout gets its cache exactly as generation fills it: the prefill's real prompt
tokens of its shard (`cache_layout` from the same boundaries and local indices `shard_batch`
uses; padding slots hold garbage that must never be read), then the decoded tokens it owns by the
owner rule, step after step. Each rank's split-KV partial (chunks of 3 slots, so the in-rank merge
runs too) is folded over the ranks in SP-rank order (`fold_partials`, what `merge_partials` does
after its all-gather) and compared with softmax attention in float64 of each row's query over its
keys: fp32 within 2e-6 relative (summation order only), bf16 K/V and queries within the bf16
rounding of the inputs (the kernel reads them as they are and computes in fp32, so the result is
the fp32 attention of the rounded inputs: compared with that at 2e-6). Packed prompts of unequal
lengths (one shorter than the SP degree), GQA (4 query heads on 2 KV heads), a sliding window
smaller than the prompts, Gemma 2's softcap and attention sinks; the cache in host buffers too.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_longctx.integrations import generation_binding
from hf_longctx.integrations.generation_binding import GenerationBinding
from hf_longctx.ops.decode_attention import decode_partial, visibility_masks
from hf_longctx.ops.decode_cache import DecodeCache, cache_layout, owned_rows
from hf_longctx.ops.decode_merge import fold_partials, merge_partials
from tests.helpers.decode_cases import LAYOUTS, padded_cu, rank_indices, reference_step

LENGTHS = [7, 12, 3]  # packed prompts; 3 < 4 ranks: some ranks hold none of that row's prompt
H, H_KV, D = 4, 2, 8
STEPS = 5  # decode steps before the checked one


def _global_kv(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = [p + STEPS + 1 for p in LENGTHS]
    keys = [torch.randn(n, H_KV, D, generator=g).to(dtype) for n in total]
    values = [torch.randn(n, H_KV, D, generator=g).to(dtype) for n in total]
    q = torch.randn(len(LENGTHS), H, D, generator=g).to(dtype)
    return q, keys, values


def _new_kv(keys, values, t):
    """Decode step t's new K/V of every row: [N, H_kv, D] each."""
    return (torch.stack([keys[n][LENGTHS[n] + t] for n in range(len(LENGTHS))]),
            torch.stack([values[n][LENGTHS[n] + t] for n in range(len(LENGTHS))]))


def _rank_cache(cu, idx, sp, rank, keys, values, *, steps, layers=1, on_host=False):
    """SP rank `rank`'s cache of `layers` layers (the same K/V in each) after the prefill and decode
    steps 0 .. steps - 1, and its valid slot count."""
    lay = cache_layout(LENGTHS, cu, idx, sp=sp, sp_rank=rank, max_new_tokens=STEPS + 2)
    cache = DecodeCache(lay, "cpu", on_host=on_host)
    # the shard's rows as the attention sees them: real tokens' K/V, padding rows random garbage
    k_local = torch.randn(idx.numel(), H_KV, D).to(keys[0].dtype) * 100
    v_local = torch.randn(idx.numel(), H_KV, D).to(keys[0].dtype) * 100
    for i, g in enumerate(idx.tolist()):
        doc = max(d for d in range(len(cu) - 1) if cu[d] <= g)
        if doc < len(LENGTHS) and g - cu[doc] < LENGTHS[doc]:
            k_local[i], v_local[i] = keys[doc][g - cu[doc]], values[doc][g - cu[doc]]
    half = idx.numel() // 2  # written in two row chunks, as memory="max" captures them
    filled = lay.step_base[0]
    for layer in range(layers):
        cache.write_prompt(layer, k_local[:half], v_local[:half])
        cache.write_prompt(layer, k_local[half:], v_local[half:])
    cache.check_prompt(layers)
    for t in range(steps):
        for layer in range(layers):
            filled = cache.append(layer, t, *_new_kv(keys, values, t))
    return cache, filled


def _sp_step(u, r, f, q, keys, values, on_host=False, **kw):
    """The folded result of every rank's partial at decode step STEPS (out [N, H, D] fp32)."""
    cu = padded_cu(LENGTHS, r, u, f)
    sp = u * r
    parts = []
    for rank, idx in enumerate(rank_indices(cu, u, r, f)):
        cache, filled = _rank_cache(cu, idx, sp, rank, keys, values, steps=STEPS + 1, on_host=on_host)
        qpos = torch.tensor([p + STEPS for p in LENGTHS])
        out, lse = decode_partial(q, cache.keys[0], cache.values[0], cache.slot_rows, cache.slot_pos, qpos, filled,
                                  chunk=3, **kw)
        parts.append(torch.cat([out, lse.unsqueeze(-1)], -1))
    return fold_partials(parts)


@pytest.mark.parametrize("u,r,f", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("extra", [{}, {"window": 4}, {"softcap": 2.0}, {"sinks": True}])
def test_decode_step_equals_single_process_attention(u, r, f, dtype, extra):
    torch.manual_seed(1)
    q, keys, values = _global_kv(dtype)
    kw = {"scale": D ** -0.5, **{k: v for k, v in extra.items() if k != "sinks"}}
    sinks = torch.randn(H) if extra.get("sinks") else None
    out, lse = _sp_step(u, r, f, q, keys, values, **kw)
    got = merge_partials(out, lse, sinks=sinks)
    want = reference_step(q.float(), [k.float() for k in keys], [v.float() for v in values], LENGTHS, STEPS,
                          sinks=sinks, **kw)
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6)


def test_owner_rule_balances_the_shards():
    """Per step every rank takes floor or ceil of N / SP new tokens, every row's tokens go round the ranks."""
    for n_rows, sp in ((5, 4), (3, 4), (8, 2)):
        for t in range(9):
            counts = [len(owned_rows(t, n_rows, sp, k)) for k in range(sp)]
            assert sum(counts) == n_rows and max(counts) - min(counts) <= 1, (n_rows, sp, t, counts)
        for n in range(n_rows):
            owners = [k for t in range(2 * sp) for k in range(sp) if n in owned_rows(t, n_rows, sp, k)]
            assert owners == [(n + t) % sp for t in range(2 * sp)]


def test_a_rank_without_keys_returns_the_merge_identity():
    q = torch.randn(2, H, D)
    empty = torch.empty(0, H_KV, D)
    out, lse = decode_partial(q, empty, empty, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long),
                              torch.tensor([3, 4]), 0, scale=1.0)
    assert out.abs().max() == 0 and torch.isneginf(lse).all()


def test_bad_shapes_name_the_values():
    q = torch.randn(2, 3, D)
    k = torch.randn(5, 2, D)
    with pytest.raises(ValueError, match="H be a multiple of H_kv"):
        decode_partial(q, k, k, torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                       5, scale=1.0)


@pytest.mark.parametrize("u,r,f", [(2, 2, 1), (4, 1, 2)])
def test_host_resident_cache_gives_the_same_result(u, r, f):
    """The cache's K/V in host buffers (`on_host=True`: views of `ops/host_pool` bytes, written by
    copies, read chunk by chunk): the same result as on the device, bit for bit."""
    q, keys, values = _global_kv(torch.float32)
    torch.manual_seed(2)
    dev = _sp_step(u, r, f, q, keys, values, scale=D ** -0.5, window=4)
    torch.manual_seed(2)
    host = _sp_step(u, r, f, q, keys, values, on_host=True, scale=D ** -0.5, window=4)
    assert torch.equal(dev[0], host[0]) and torch.equal(dev[1], host[1])


def _bits_equal(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("u,r,f", [(2, 1, 1), (4, 1, 2)])
@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_precomputed_masks_give_the_same_partial_bit_for_bit(u, r, f, chunk):
    """`visibility_masks` built once per window and handed to `decode_partial` (what the binding does
    for the layers of a step): (out, lse) bit for bit those of the masks built inside, for several
    chunks, windows and a softcap, one mask list per window read by several calls."""
    q, keys, values = _global_kv(torch.float32)
    cu = padded_cu(LENGTHS, r, u, f)
    qpos = torch.tensor([p + STEPS for p in LENGTHS])
    windows = (None, 1, 4, 100)
    for rank, idx in enumerate(rank_indices(cu, u, r, f)):
        cache, filled = _rank_cache(cu, idx, u * r, rank, keys, values, steps=STEPS + 1)
        args = (cache.keys[0], cache.values[0], cache.slot_rows, cache.slot_pos, qpos, filled)
        masks = {w: visibility_masks(cache.slot_rows, cache.slot_pos, qpos, filled, w, chunk) for w in windows}
        assert len(masks[None]) == -(-filled // chunk)
        for softcap in (None, 2.0):
            for w in windows + windows[::-1]:  # every list read twice, windows alternating as Gemma 2's layers
                kw = dict(scale=D ** -0.5, window=w, softcap=softcap, chunk=chunk)
                inside = decode_partial(q, *args, **kw)
                given = decode_partial(q, *args, masks=masks[w], **kw)
                assert _bits_equal(inside[0], given[0]) and _bits_equal(inside[1], given[1]), (rank, w, softcap)


def test_masks_of_other_chunks_are_refused_by_length():
    q, keys, values = _global_kv(torch.float32)
    cu = padded_cu(LENGTHS, 1, 2, 1)
    idx = rank_indices(cu, 2, 1, 1)[0]
    cache, filled = _rank_cache(cu, idx, 2, 0, keys, values, steps=STEPS + 1)
    qpos = torch.tensor([p + STEPS for p in LENGTHS])
    args = (q, cache.keys[0], cache.values[0], cache.slot_rows, cache.slot_pos, qpos, filled)
    stale = visibility_masks(cache.slot_rows, cache.slot_pos, qpos, filled - 3, None, 3)  # the previous count
    with pytest.raises(ValueError, match=rf"{len(stale)} chunk masks for filled = {filled} slots in chunks of 3, "
                                         rf"which make {-(-filled // 3)} chunks"):
        decode_partial(*args, scale=1.0, chunk=3, masks=stale)
    wrong = visibility_masks(cache.slot_rows, cache.slot_pos, qpos, filled - 1, None, 3)  # same count, short last
    assert len(wrong) == -(-filled // 3) and filled % 3 != 1
    with pytest.raises(ValueError, match=rf"chunk mask {len(wrong) - 1} has shape \({(filled - 1) % 3 or 3},\)"):
        decode_partial(*args, scale=1.0, chunk=3, masks=wrong)


def test_the_binding_builds_masks_once_per_step_and_window(monkeypatch):
    """`GenerationBinding.attend` over the layers of two steps, windows alternating (Gemma 2): every
    layer's output bit for bit `decode_partial`'s with its own masks; one mask list per window and
    step, shared by that step's layers of the window, rebuilt by the next step."""
    q, keys, values = _global_kv(torch.float32)
    cu = padded_cu(LENGTHS, 1, 2, 1)
    idx = rank_indices(cu, 2, 1, 1)[1]
    windows = [4, None, 4, None]  # layer -> window
    cache, _ = _rank_cache(cu, idx, 2, 1, keys, values, steps=STEPS - 1, layers=len(windows))
    binding = GenerationBinding(cache, SimpleNamespace(sp=1, sp_group=None), torch.tensor(LENGTHS), chunk=3)
    built = []
    monkeypatch.setattr(generation_binding, "visibility_masks",
                        lambda *a: built.append(a[4]) or visibility_masks(*a))  # a[4]: the window
    kept = []
    for t in (STEPS - 1, STEPS):
        binding.begin_step(t)
        assert binding.masks == {}
        new_k, new_v = _new_kv(keys, values, t)
        qpos = torch.tensor([p + t for p in LENGTHS])
        for layer, w in enumerate(windows):
            got = binding.attend(layer, q[None], new_k[None], new_v[None], scale=D ** -0.5, window=w, softcap=None,
                                 sinks=None)
            want, _ = decode_partial(q, cache.keys[layer], cache.values[layer], cache.slot_rows, cache.slot_pos, qpos,
                                     cache.layout.step_base[t + 1], scale=D ** -0.5, window=w, chunk=3)
            assert _bits_equal(got[0], want), (t, layer)
        assert set(binding.masks) == {4, None}
        kept.append(binding.masks)
    assert built == [4, None, 4, None]  # per step, each window's first layer
    assert all(kept[0][w] is not kept[1][w] for w in (4, None))
