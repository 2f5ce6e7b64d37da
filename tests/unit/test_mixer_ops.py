"""The tensor ops of `ops/mixers/` against transformers' own torch functions, one process.

- `doc_causal_conv` against `causal_conv1d_fn` (the torch fallback of the modules' files)
  on a single document, and on packed documents against one call per document;
- `gdn_sequence_parallel` / `mamba2_sequence_parallel` with no process group (SP = 1)
  against conv + `torch_chunk_gated_delta_rule` / `mamba2_chunk_scan` on ONE document,
  forward and backward (every input and parameter gradient);
- the halo plan, simulated for every rank of a zigzag layout whose chunks are shorter than
  K-1: every tap must read exactly the global position t-(K-1-j) of the same document, or
  the zero row;
- the head splits: every head on exactly one rank, refusals naming the numbers.
fp32 throughout; tolerances 1e-5 (forward) / 1e-4 (gradients) relative: only the
summation order differs (taps vs conv1d; per-head q/k vs repeat_interleave).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_longctx.ops.mixers.conv import doc_causal_conv
from hf_longctx.ops.mixers.gdn import GDNHeads, gdn_sequence_parallel
from hf_longctx.ops.mixers.layout import SequenceLayout
from hf_longctx.ops.mixers.mamba2 import Mamba2Heads, mamba2_sequence_parallel


def rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _conv_fn():
    from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn

    return causal_conv1d_fn


@pytest.mark.parametrize("kernel", [2, 3, 4])
def test_doc_causal_conv_matches_transformers_per_document(kernel):
    torch.manual_seed(0)
    docs = [5, 1, 9, 2]
    x = torch.randn(1, sum(docs), 6)
    w, bias = torch.randn(6, kernel), torch.randn(6)
    cu = [0]
    for n in docs:
        cu.append(cu[-1] + n)
    out = doc_causal_conv(x, SequenceLayout(tuple(cu), 1, 1), w, bias)  # [1, S, C]
    conv = _conv_fn()
    ref = torch.cat([conv(x[:, a:b].transpose(1, 2), w, bias).transpose(1, 2) for a, b in zip(cu[:-1], cu[1:])], 1)
    assert rel(out, ref) <= 1e-6
    # and on the packed row as one document, exactly transformers' single-document call
    whole = doc_causal_conv(x, SequenceLayout((0, x.shape[1]), 1, 1), w, bias)
    assert rel(whole, conv(x.transpose(1, 2), w, bias).transpose(1, 2)) <= 1e-6
    assert rel(whole, out) > 1e-3  # the document boundaries matter


def _grads(outs, inputs):
    torch.manual_seed(1)
    probe = [torch.randn_like(o) for o in outs]
    return torch.autograd.grad(sum((o * p).sum() for o, p in zip(outs, probe)), inputs)


def test_gdn_op_matches_transformers_on_one_document():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    torch.manual_seed(0)
    hk, hv, dk, dv, s, k = 2, 4, 4, 3, 11, 4
    conv_dim = 2 * hk * dk + hv * dv
    mixed = torch.randn(1, s, conv_dim, requires_grad=True)
    beta = torch.rand(1, s, hv, requires_grad=True)
    a = torch.randn(1, s, hv, requires_grad=True)
    w = torch.randn(conv_dim, k, requires_grad=True)
    A_log, dt_bias = torch.randn(hv, requires_grad=True), torch.randn(hv, requires_grad=True)
    params = [mixed, beta, a, w, A_log, dt_bias]

    out = gdn_sequence_parallel(
        mixed, beta, a, conv_weight=w, conv_bias=None, activation=F.silu, A_log=A_log, dt_bias=dt_bias, head_k_dim=dk,
        head_v_dim=dv, heads=GDNHeads.split(hk, hv, 1), core=torch_chunk_gated_delta_rule,
        lay=SequenceLayout((0, s), 1, 1), rank=0, group=None,
    )
    qkv = F.silu(_conv_fn()(mixed.transpose(1, 2), w, None).transpose(1, 2))
    q, kk, v = qkv.split([hk * dk, hk * dk, hv * dv], -1)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    ref, _ = torch_chunk_gated_delta_rule(
        # key heads expanded per value head as the modules do (transformers 5.17's core needs equal heads)
        q.reshape(1, s, hk, dk).repeat_interleave(hv // hk, 2), kk.reshape(1, s, hk, dk).repeat_interleave(hv // hk, 2),
        v.reshape(1, s, hv, dv), g=g, beta=beta,
        use_qk_l2norm_in_kernel=True,
    )
    assert rel(out, ref) <= 1e-5
    for got, want in zip(_grads([out], params), _grads([ref], params)):
        assert rel(got, want) <= 1e-4


def test_mamba2_op_matches_transformers_on_one_document():
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan

    torch.manual_seed(0)
    h, g, p, n, s, k = 4, 2, 3, 5, 13, 4
    inner = h * p
    xbc = torch.randn(1, s, inner + 2 * g * n, requires_grad=True)
    dt = torch.randn(1, s, h, requires_grad=True)
    w, bias = torch.randn(inner + 2 * g * n, k, requires_grad=True), torch.randn(inner + 2 * g * n, requires_grad=True)
    A_log, D, dt_bias = (torch.randn(h, requires_grad=True) for _ in range(3))
    params = [xbc, dt, w, bias, A_log, D, dt_bias]
    out = mamba2_sequence_parallel(
        xbc, dt, conv_weight=w, conv_bias=bias, activation=F.silu, A_log=A_log, D=D, dt_bias=dt_bias,
        dt_limit=(0.0, float("inf")), head_dim=p, state=n, chunk_size=4, heads=Mamba2Heads.split(h, g, 1),
        scan=mamba2_chunk_scan, lay=SequenceLayout((0, s), 1, 1), rank=0, group=None,
    )
    conv = F.silu(_conv_fn()(xbc.transpose(1, 2), w, bias).transpose(1, 2))
    x, B, C = conv.split([inner, g * n, g * n], -1)
    ref = mamba2_chunk_scan(
        x.reshape(1, s, h, p), dt, -torch.exp(A_log.float()), B.reshape(1, s, g, n), C.reshape(1, s, g, n), chunk_size=4,
        D=D, dt_bias=dt_bias, dt_softplus=True,
    ).reshape(1, s, inner)
    assert rel(out, ref) <= 1e-5
    for got, want in zip(_grads([out], params), _grads([ref], params)):
        assert rel(got, want) <= 1e-4


@pytest.mark.parametrize("ring,ulysses,kernel", [(4, 1, 4), (2, 2, 3), (1, 4, 4), (2, 1, 2)])
def test_halo_plan_reads_the_previous_positions_of_the_same_document(ring, ulysses, kernel):
    lay = SequenceLayout((0, 8, 32, 40, 48), ring, ulysses)  # chunks of 1 token on ring 4: the halo spans ranks
    plan = lay.halo(kernel)
    for p, idx in enumerate(lay.indices):
        # rank p's extended tensor holds global positions: its shard, each source's halo rows, a sentinel (-1)
        recv = [lay.indices[q][plan.send_rows[q][p]] for q in range(lay.sp)]
        assert [r.numel() for r in recv] == plan.recv_counts[p]
        ext = torch.cat([idx, *recv, torch.tensor([-1])])
        got = ext[plan.tap_rows[p]]  # [S_local, K]
        pos = idx[:, None] - torch.arange(kernel - 1, -1, -1)[None]  # [S_local, K]
        want = torch.where(pos >= lay.doc_start[idx][:, None], pos, torch.full_like(pos, -1))
        assert torch.equal(got, want), f"rank {p}"
        # the conv1d segments: the K inputs of an unpadded conv1d at out_index are the same taps
        seg = ext[plan.seg_rows[p]]  # [N'] positions laid out for conv1d
        windows = seg[plan.out_index[p][:, None] + torch.arange(kernel)[None]]  # [S_local, K]
        assert torch.equal(windows, want), f"rank {p} segments"
        assert not bool(torch.isin(torch.cat(recv), idx).any()), "a rank fetched a row it holds"


def test_head_splits_cover_every_head_once_and_refuse_with_the_numbers():
    for hk, hv, sp in [(2, 4, 2), (2, 4, 4), (1, 3, 2), (3, 6, 4), (4, 8, 3)]:
        heads = GDNHeads.split(hk, hv, sp)
        covered = [h for v_lo, v_hi, _, _ in heads.ranks for h in range(v_lo, v_hi)]
        assert covered == list(range(hv))
        for v_lo, v_hi, k_lo, k_hi in heads.ranks:
            assert {h // (hv // hk) for h in range(v_lo, v_hi)} == set(range(k_lo, k_hi))
    with pytest.raises(ValueError, match=r"3 value heads .*1 key heads.* 4 ranks"):
        GDNHeads.split(1, 3, 4)
    for h, g, sp in [(4, 1, 4), (4, 2, 4), (3, 1, 2), (8, 4, 3)]:
        m = Mamba2Heads.split(h, g, sp)
        assert [x for lo, hi, _, _ in m.ranks for x in range(lo, hi)] == list(range(h))
        for lo, hi, g_lo, g_hi in m.ranks:
            assert {x // (h // g) for x in range(lo, hi)} == set(range(g_lo, g_hi))
    with pytest.raises(ValueError, match=r"3 heads cannot be split over an SP group of 4"):
        Mamba2Heads.split(3, 1, 4)
