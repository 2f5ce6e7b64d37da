"""ops/blocks + ops/kernels against the dense single-process reference (tests/helpers/reference.py).

float64 runs every kernel (aten CPU op and math kernel) so comparisons are exact up to
reassociation; float32 and bf16 check the aten op at the precision actually trained with.
"""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_longctx.layout import Run, ring_stream, runs_to_indices
from hf_longctx.ops import math_kernel
from hf_longctx.ops.blocks import block_mask, plan_blocks, score_count
from hf_longctx.ops.kernels import block_backward, block_forward, local_attention, varlen_backward, varlen_forward
from hf_longctx.ops.math_kernel import math_backward, math_forward
from hf_longctx.ops.lse import merge
from tests.helpers.reference import make_runs, random_runs, reference_attention, reference_mask, rel_err

# float64: products of O(1) numbers summed over <= 40 keys; reassociation between the
# blockwise kernels and dense math leaves ~1e-15 relative; 1e-10 cannot hide a wrong term.
F64 = 1e-10
CU = [0, 5, 22, 23, 32]  # uneven documents, one of length 1
D = 8
MODES = [  # (causal, window, softcap)
    (True, None, None), (False, None, None), (True, 4, None), (False, 3, None), (True, None, 2.0), (False, 5, 1.5),
]


def _tensors(s, h, hkv, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, s, h, D, generator=g, dtype=torch.float64)
    k = torch.randn(1, s, hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, s, hkv, D, generator=g, dtype=torch.float64)
    dout = torch.randn(1, s, h, D, generator=g, dtype=torch.float64)
    return [x.to(dtype) for x in (q, k, v, dout)]


def _ref(q, k, v, dout, cu, causal, window, softcap):
    """Reference out [B, S, H, D], grads, and lse [B, H, S], all float64."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = reference_attention(q, k, v, cu, causal=causal, window=window, softcap=softcap, scale=D**-0.5)
    out.backward(dout.double())
    h, hkv = q.shape[2], k.shape[2]
    s = q.transpose(1, 2) @ k.transpose(1, 2).repeat_interleave(h // hkv, 1).transpose(-1, -2) * D**-0.5
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    allowed = reference_mask(cu, 1, q.shape[1], causal=causal, window=window)[:, None]
    lse = torch.logsumexp(s.masked_fill(~allowed, float("-inf")), -1)  # [B, H, S]
    return out.detach(), q.grad, k.grad, v.grad, lse.detach()


def _internal(*xs):
    return [x.transpose(1, 2) for x in xs]  # [B, S, H, D] -> [B, H, S, D]


@pytest.mark.parametrize("hkv", [4, 2, 1])
@pytest.mark.parametrize("causal,window,softcap", MODES)
def test_local_attention_matches_reference(hkv, causal, window, softcap):
    q, k, v, dout = _tensors(32, 4, hkv)
    ref_out, ref_dq, ref_dk, ref_dv, ref_lse = _ref(q, k, v, dout, CU, causal, window, softcap)
    runs = make_runs(CU)
    qi, ki, vi = (x.clone().requires_grad_() for x in _internal(q, k, v))
    out = local_attention(qi, ki, vi, runs, runs, scale=D**-0.5, causal=causal, window=window, softcap=softcap)
    out.backward(dout.transpose(1, 2))
    _, lse = varlen_forward(*_internal(q, k, v), runs, runs, scale=D**-0.5, causal=causal, window=window, softcap=softcap)
    assert lse.dtype == torch.float64
    for got, want in [(out, ref_out), (qi.grad, ref_dq), (ki.grad, ref_dk), (vi.grad, ref_dv)]:
        assert rel_err(got.transpose(1, 2), want) < F64
    torch.testing.assert_close(lse, ref_lse, rtol=F64, atol=F64)


def _layouts():
    cu = [0, 8, 24, 28, 40]  # multiples of 2R = 4
    zig_q = ring_stream(cu, 2, 1)
    zig_k = ring_stream(cu, 2, 0) + ring_stream(cu, 2, 1)
    rng = random.Random(0)
    return [(cu, zig_q, zig_k)] + [(cu, random_runs(cu, rng), random_runs(cu, rng)) for _ in range(3)]


@pytest.mark.parametrize("layout", range(4))
@pytest.mark.parametrize("causal,window,softcap", [MODES[0], MODES[2], MODES[3], MODES[4]])
def test_permuted_runs_and_key_split(layout, causal, window, softcap):
    """q and k in arbitrary local orders (zigzag, random); keys split in two halves whose
    forward results merge, and whose backward pieces (given the merged out/lse) sum, to the whole."""
    cu, q_runs, k_runs = _layouts()[layout]
    q, k, v, dout = _tensors(40, 4, 2, seed=layout)
    qi_idx, ki_idx = runs_to_indices(q_runs), runs_to_indices(k_runs)
    dout = torch.zeros_like(dout).index_copy(1, qi_idx, dout[:, qi_idx])  # only the local queries feed dk, dv
    ref_out, ref_dq, ref_dk, ref_dv, ref_lse = _ref(q, k, v, dout, cu, causal, window, softcap)
    qi, do = (x[:, qi_idx].transpose(1, 2) for x in (q, dout))  # [B, H, Sq, D] in local order
    ki, vi = (x[:, ki_idx].transpose(1, 2) for x in (k, v))  # [B, H_kv, Sk, D]
    kw = dict(scale=D**-0.5, causal=causal, window=window, softcap=softcap)
    out, lse = varlen_forward(qi, ki, vi, q_runs, k_runs, **kw)
    assert rel_err(out.transpose(1, 2), ref_out[:, qi_idx]) < F64
    torch.testing.assert_close(lse, ref_lse[:, :, qi_idx], rtol=F64, atol=F64)

    half = len(k_runs) // 2
    n0 = sum(r.length for r in k_runs[:half])
    parts = [(k_runs[:half], slice(0, n0)), (k_runs[half:], slice(n0, None))]
    pieces = [varlen_forward(qi, ki[:, :, s], vi[:, :, s], q_runs, kr, **kw) for kr, s in parts]
    m_out, m_lse = merge(*pieces[0], *pieces[1])
    assert rel_err(m_out, out) < F64
    torch.testing.assert_close(m_lse, lse, rtol=F64, atol=F64)

    grads = [varlen_backward(do, qi, ki[:, :, s], vi[:, :, s], out, lse, q_runs, kr, **kw) for kr, s in parts]
    dq = grads[0][0] + grads[1][0]
    dk, dv = torch.cat([grads[0][1], grads[1][1]], 2), torch.cat([grads[0][2], grads[1][2]], 2)
    assert rel_err(dq.transpose(1, 2), ref_dq[:, qi_idx]) < F64
    assert rel_err(dk.transpose(1, 2), ref_dk[:, ki_idx]) < F64
    assert rel_err(dv.transpose(1, 2), ref_dv[:, ki_idx]) < F64


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 6)])
def test_aten_float32_and_bf16(causal, window):
    torch.set_num_threads(1)
    cu, runs = [0, 40, 64, 70, 96], make_runs([0, 40, 64, 70, 96])
    q, k, v, dout = _tensors(96, 4, 2, seed=3)
    ref = _ref(q, k, v, dout, cu, causal, window, None)[:4]
    for dtype in (torch.float32, torch.bfloat16):
        qs, ks, vs, dos = (x.to(dtype) for x in (q, k, v, dout))
        qi, ki, vi = (x.clone().requires_grad_() for x in _internal(qs, ks, vs))
        out = local_attention(qi, ki, vi, runs, runs, scale=D**-0.5, causal=causal, window=window)
        out.backward(dos.transpose(1, 2))
        assert out.dtype == dtype and qi.grad.dtype == dtype and ki.grad.dtype == dtype
        got = [out.transpose(1, 2), qi.grad.transpose(1, 2), ki.grad.transpose(1, 2), vi.grad.transpose(1, 2)]
        if dtype == torch.float32:  # fp32 eps 1.2e-7 times sums over <= 40 keys and 4 GQA heads, with headroom
            for g, r in zip(got, ref):
                assert rel_err(g, r) <= 2e-5
        else:  # the design's bf16 bar: no worse than 2x plain dense bf16 math on the same inputs
            dense = _dense_bf16(qs, ks, vs, dos, cu, causal, window)
            for g, dn, r in zip(got, dense, ref):
                assert rel_err(g, r) <= 2 * rel_err(dn, r)


def _dense_bf16(q, k, v, dout, cu, causal, window):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = reference_attention(q, k, v, cu, causal=causal, window=window, scale=D**-0.5)
    out.backward(dout)
    return out, q.grad, k.grad, v.grad


@pytest.mark.parametrize("kind", ["full", "causal", "mask", "mask+causal"])
@pytest.mark.parametrize("hkv", [4, 1])
def test_math_kernel_matches_aten_blockwise(kind, hkv, monkeypatch):
    """The math kernel (chunked over 3 query rows to exercise chunking) equals the aten op
    on every tile kind, including rows with no allowed key (out 0, lse -inf, zero grads)."""
    g = torch.Generator().manual_seed(7)
    q, dout = (torch.randn(1, 4, 10, D, generator=g, dtype=torch.float64) for _ in range(2))
    sk = 10 if kind == "causal" else 13
    k, v = (torch.randn(1, hkv, sk, D, generator=g, dtype=torch.float64) for _ in range(2))
    mask = None
    if kind.startswith("mask"):
        mask = torch.rand(10, sk, generator=g) < 0.5
        mask[2] = False  # an empty row
        mask[4, 5:] = False  # under the causal rule row 4 keeps only keys 0..4
    causal = kind in ("causal", "mask+causal")
    kw = dict(scale=0.3, causal=causal, mask=mask, softcap=None)
    o_a, l_a = block_forward(q, k, v, **kw)
    g_a = block_backward(dout, q, k, v, o_a, l_a, **kw)
    monkeypatch.setattr(math_kernel, "chunk_shape", lambda q, sk: (3, 4))  # 3 rows x 4 keys: both loops run
    o_m, l_m = math_forward(q, k, v, **kw)
    g_m = math_backward(dout, q, k, v, o_m, l_m, **kw)
    torch.testing.assert_close(o_m, o_a, rtol=F64, atol=F64)
    torch.testing.assert_close(l_m, l_a, rtol=F64, atol=F64)
    for x, y in zip(g_m, g_a):
        torch.testing.assert_close(x, y, rtol=F64, atol=F64)
    if mask is not None:
        assert torch.isneginf(l_a[:, :, 2]).all() and (o_a[:, :, 2] == 0).all()
        assert (g_a[0][:, :, 2] == 0).all() and not any(x.isnan().any() for x in g_a)


def test_queries_without_keys_get_zero_and_neg_inf():
    q, k, v, dout = _internal(*_tensors(32, 4, 2))
    q_runs, k_runs = make_runs(CU)[1:3], make_runs(CU)[0:2]  # doc 2's queries see no key of docs 0, 1
    q, dout = q[:, :, 5:23], dout[:, :, 5:23]
    k, v = k[:, :, :22], v[:, :, :22]
    out, lse = varlen_forward(q, k, v, q_runs, k_runs, scale=0.3, causal=True)
    assert torch.isneginf(lse[:, :, 17]).all() and (out[:, :, 17] == 0).all()
    assert torch.isfinite(lse[:, :, :17]).all()
    dq, dk, dv = varlen_backward(dout, q, k, v, out, lse, q_runs, k_runs, scale=0.3, causal=True)
    assert (dq[:, :, 17] == 0).all() and not dq.isnan().any() and not dk.isnan().any()


def test_bad_inputs_raise():
    q, k, v, _ = _internal(*_tensors(32, 4, 2))
    runs = make_runs(CU)
    with pytest.raises(ValueError, match="31"):
        varlen_forward(q, k, v, runs[:-1] + [Run(3, 23, 8)], runs, scale=1.0, causal=True)
    with pytest.raises(ValueError, match="H=4"):
        k3 = torch.zeros(1, 3, 32, D, dtype=q.dtype)  # 4 query heads cannot share 3 kv heads
        varlen_forward(q, k3, k3, runs, runs, scale=1.0, causal=True)
    with pytest.raises(ValueError, match="window"):
        varlen_forward(q, k, v, runs, runs, scale=1.0, causal=True, window=0)
    with pytest.raises(ValueError, match="mask"):
        block_forward(q, k, v, scale=1.0, causal=False, mask=torch.ones(32, 31, dtype=torch.bool), softcap=None)


@st.composite
def _plans(draw):
    lengths = draw(st.lists(st.integers(1, 12), min_size=1, max_size=4))
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    rng = random.Random(draw(st.integers(0, 2**16)))
    runs = [random_runs(cu, rng) for _ in range(2)]
    q_runs = rng.sample(runs[0], rng.randint(1, len(runs[0])))  # a random subset of the queries
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.integers(1, 14)))
    return cu, q_runs, runs[1], causal, window


@settings(max_examples=150, deadline=None)
@given(_plans())
def test_plan_blocks_is_exact(plan):
    cu, q_runs, k_runs, causal, window = plan
    dense = reference_mask(cu, 1, cu[-1], causal=causal, window=window)[0]  # [S, S] global
    local = dense[runs_to_indices(q_runs)][:, runs_to_indices(k_runs)]  # [Sq, Sk] local order
    blocks = plan_blocks(q_runs, k_runs, causal=causal, window=window)
    assert score_count(blocks, causal=causal, window=window) == int(local.sum())
    covered = torch.zeros_like(local)
    for b in blocks:
        tile = local[b.q_lo:b.q_hi, b.k_lo:b.k_hi]
        assert tile.any()
        assert not covered[b.q_lo:b.q_hi, b.k_lo:b.k_hi].any()
        covered[b.q_lo:b.q_hi, b.k_lo:b.k_hi] = True
        assert torch.equal(block_mask(b, causal=causal, window=window), tile)
        if b.kind == "full":
            assert tile.all()
        elif b.kind == "causal":
            assert b.q_start == b.k_start and torch.equal(tile, torch.ones_like(tile).tril())
        else:
            assert not tile.all() and not (tile.shape[0] == tile.shape[1] and torch.equal(tile, torch.ones_like(tile).tril()) and b.q_start == b.k_start)
    assert not (local & ~covered).any()  # every allowed pair lies in some tile


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("ring", [1, 4])
def test_window_tiles_never_exceed_window_squared(causal, ring):
    # One 64K-token document with a 512 window: without window-aligned pieces the plan held
    # one masked tile of the whole document (a dense S x S mask); now every tile is at most
    # window x window and the plan still counts exactly the band's allowed pairs.
    s, window = 65536, 512
    cu = [0, s]
    q_runs = ring_stream(cu, ring, 0)
    for src in range(ring):
        k_runs = ring_stream(cu, ring, src)
        plan = plan_blocks(q_runs, k_runs, causal=causal, window=window)
        # (distant zigzag chunks share no pair within the window: an empty plan is right)
        assert max((b.q_hi - b.q_lo for b in plan), default=0) <= window
        assert max((b.k_hi - b.k_lo for b in plan), default=0) <= window
        qpos, kpos = runs_to_indices(q_runs), runs_to_indices(k_runs)
        diff = qpos[:, None] - kpos[None, :] if ring > 1 else None
        if diff is not None:  # small enough to count densely: S/R x S/R
            allowed = (diff >= 0) & (diff < window) if causal else diff.abs() < window
            assert score_count(plan, causal=causal, window=window) == int(allowed.sum())
    if ring == 1:  # S x S is too big to count densely: the band has a closed form
        band = sum(min(i + 1, window) for i in range(s)) if causal else sum(
            min(s - 1, i + window - 1) - max(0, i - window + 1) + 1 for i in range(s))
        assert score_count(plan, causal=causal, window=window) == band


@pytest.mark.parametrize("f", [2, 4])
def test_kv_replication_backward_sums_in_fp32_once(f):
    """replicate_kv relies on autograd's repeat_interleave backward summing the bf16 replicas
    in fp32 with one rounding (bitwise equal to an explicit fp32 sum); a torch that rounded
    per addition would fail here before the bf16 distributed tests do."""
    from hf_longctx.ops.ulysses import replicate_kv

    g = torch.Generator().manual_seed(f)
    q = torch.randn(1, 64, 8, 16, generator=g).bfloat16()  # 8 query heads, one KV head (MQA)
    k = torch.randn(1, 64, 1, 16, generator=g).bfloat16().requires_grad_()
    k2, _ = replicate_kv(q, k, k.detach(), ulysses=f)  # [1, 64, f, 16]: one replica per Ulysses rank
    assert k2.shape[2] == f
    grad = torch.randn(k2.shape, generator=g).bfloat16()
    (k2 * grad).sum().backward()
    assert torch.equal(k.grad, grad.sum(2, keepdim=True, dtype=torch.float32).bfloat16())
