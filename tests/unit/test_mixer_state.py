"""State passing for the linear mixers, one process: the scan, its plan, the kernels' contracts,
the cost rule and `patch(mixers=)`'s refusals.

- the segmented scan (`ops/mixers/state_passing.py`) on hand-made chains of runs all held by
  one rank (the rounds, the shift and the adjoint run exactly as on P ranks, the exchange is
  a copy): forward against the sequential recurrence, backward by `gradcheck` in float64,
  for matrix maps (the delta rule) and scalar maps (Mamba-2);
- the plan of real layouts: every document's runs in global order, ⌈log2⌉ rounds, the
  flags of which runs start and continue a document;
- the varlen GDN path against flash-linear-attention's exact signature (`tests/helpers/emulated_mixer_kernels.py`):
  ONE call over all runs of a rank of a zigzag layout gives the same o⁰, q̃, M, S⁰ and
  gradients as one transformers torch call per run;
- the cost rule on real model sizes, and the refusals of `patch(mixers=...)` naming the class and the fix;
- no host sync: both state ops on the META device (no data: a value read raises) with every
  SP rank's plan, under the guard of tests/unit/test_mixer_no_sync.py.
Tolerances: exact comparisons in float64 (1e-10), fp32 1e-5 / 1e-4 (summation order only).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from hf_longctx.ops.mixers import state_passing
from hf_longctx.ops.mixers.cost import Links, MixerDims, choose, head_traffic, mixers_of_config, one_document_state_traffic
from hf_longctx.ops.mixers.layout import SequenceLayout
from hf_longctx.ops.mixers.state_passing import MATRIX, SCALAR, ChainPlan, _StatePassing, build_scan
from tests.helpers.emulated_mixer_kernels import FLAEmulation


def _chain_plan(chains):
    return ChainPlan(build_scan(chains, 1), build_scan([c[::-1] for c in chains], 1), (), ())


CHAINS = [[(0, 0), (0, 3), (0, 1), (0, 5), (0, 2), (0, 7), (0, 8)], [(0, 4), (0, 6)], [(0, 9), (0, 10), (0, 11)]]


def _sequential(a, b, kind):
    x = torch.zeros_like(b)
    for chain in CHAINS:
        s = torch.zeros_like(b[0])
        for (_, i), (_, j) in zip(chain[:-1], chain[1:]):
            s = kind.mul(a[i], s) + b[i]
            x = x.index_copy(0, torch.tensor([j]), s[None])
    return x


@pytest.mark.parametrize("kind,a_shape", [(MATRIX, (2, 3, 3)), (SCALAR, (2, 1, 1))], ids=["matrix", "scalar"])
def test_scan_matches_the_recurrence_and_its_adjoint(kind, a_shape):
    torch.manual_seed(0)
    plan = _chain_plan(CHAINS)
    assert len(plan.forward.rounds) == 3  # 6 maps in the longest chain: rounds of 1, 2, 4
    a = (torch.randn(12, *a_shape, dtype=torch.float64) * 0.5).requires_grad_()
    b = torch.randn(12, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    out = _StatePassing.apply(plan, kind, 0, None, a, b)
    torch.testing.assert_close(out, _sequential(a, b, kind), rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: _StatePassing.apply(plan, kind, 0, None, a, b), (a, b))


@pytest.mark.parametrize("ring,ulysses", [(4, 1), (1, 4), (2, 2), (1, 1)])
def test_plan_walks_every_document_in_global_order(ring, ulysses):
    cu = (0, 56, 64, 72, 80)
    lay = SequenceLayout(cu, ring, ulysses)
    plan = ChainPlan.of(lay)
    assert ChainPlan.of(lay) is plan  # cached on the layout
    for p, runs in enumerate(lay.runs):
        assert list(plan.starts[p]) == [r.start in cu for r in runs]
        assert list(plan.continues[p]) == [r.start + r.length not in cu for r in runs]
    # The shift hands each run's state to the NEXT run of its document, and every run that
    # does not start a document receives exactly one.
    shift, received = plan.forward.shift, []
    for p in range(lay.sp):
        for q in range(lay.sp):
            lo = sum(shift.send_counts[p][:q])
            sent = shift.send[p][lo : lo + shift.send_counts[p][q]].tolist()
            lo = sum(shift.recv_counts[q][:p])
            got = shift.target[q][lo : lo + shift.recv_counts[q][p]].tolist()
            for i, j in zip(sent, got, strict=True):
                src, dst = lay.runs[p][i], lay.runs[q][j]
                assert src.doc == dst.doc and src.start + src.length == dst.start
                received.append((q, j))
    want = sorted((p, i) for p, runs in enumerate(lay.runs) for i, r in enumerate(runs) if r.start not in cu)
    assert sorted(received) == want
    runs_per_doc = [sum(r.doc == d for runs in lay.runs for r in runs) for d in range(len(cu) - 1)]
    assert len(plan.forward.rounds) == max(0, max(runs_per_doc) - 2).bit_length()  # ⌈log2(maps)⌉


def _gdn_inputs(b, s, hk, hv, dk, dv):
    torch.manual_seed(0)
    q, k = torch.randn(b, s, hk, dk), torch.randn(b, s, hk, dk)
    v, beta = torch.randn(b, s, hv, dv), torch.rand(b, s, hv)
    g = -torch.rand(b, s, hv) * 2
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def test_varlen_gdn_call_matches_the_padded_torch_call():
    """The flash-linear-attention wiring (its emulation runs the torch path once per run) against
    the torch path's ONE call over the runs as padded rows: rank 1 of ring 2 × ulysses 2 holds
    runs that start, continue and end documents; both give the same per-run quantities and gradients."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    from hf_longctx.ops.mixers.gdn_state import _cores_padded, _cores_varlen
    from hf_longctx.ops.mixers.state_passing import run_bounds

    lay, rank = SequenceLayout((0, 40, 48, 64), 2, 2), 1
    plan = ChainPlan.of(lay)
    bounds, starts, cont = run_bounds(lay, rank), plan.starts[rank], plan.continues[rank]
    assert any(starts) and not all(starts) and any(cont)
    hk, hv, dk, dv = 1, 2, 4, 3
    ins = _gdn_inputs(2, lay.local_length, hk, hv, dk, dv)
    fla = FLAEmulation()
    got = _cores_varlen(fla.chunk_gated_delta_rule, *ins, bounds, starts, lay, rank, torch.float32)
    assert fla.calls == 1
    q, k, v, g, beta = ins
    kmap = torch.arange(hv) // (hv // hk)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return torch_chunk_gated_delta_rule(*args, **kwargs)

    want = _cores_padded(counted, q.index_select(2, kmap), k.index_select(2, kmap), v, g, beta, bounds, starts, lay, rank,
                         torch.float32)
    assert len(calls) == 1
    probe_sum = lambda runs: sum((t * (i + 1)).sum() for i, r in enumerate(runs) for t in r if t is not None)  # noqa: E731
    for (o1, q1, m1, s1), (o2, q2, m2, s2), c in zip(got, want, cont):
        torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-6)
        assert (q1 is None) == (q2 is None)
        if q2 is not None:
            torch.testing.assert_close(q1, q2, rtol=1e-5, atol=1e-6)
        if c:
            torch.testing.assert_close(m1, m2, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(s1, s2, rtol=1e-5, atol=1e-6)
    keep = lambda runs: [(o, qt, m if c else None, s if c else None) for (o, qt, m, s), c in zip(runs, cont)]  # noqa: E731
    g1 = torch.autograd.grad(probe_sum(keep(got)), ins)
    g2 = torch.autograd.grad(probe_sum(keep(want)), ins)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_varlen_only_with_the_decorated_fla_kernel(monkeypatch):
    from hf_longctx.integrations.mixers import dispatch

    def bare(*a, **kw):
        return None

    decorated = types.SimpleNamespace(__wrapped__=bare)
    monkeypatch.setattr(dispatch, "fla_gated_delta_rule", lambda: False)
    assert not dispatch.takes_cu_seqlens(decorated)  # the torch fallback refuses cu_seqlens
    monkeypatch.setattr(dispatch, "fla_gated_delta_rule", lambda: True)
    assert not dispatch.takes_cu_seqlens(bare)  # a bare torch path would ignore them in **kwargs
    assert dispatch.takes_cu_seqlens(decorated)


QWEN3_NEXT = MixerDims("gdn", heads=32, groups=16, key_dim=128, head_dim=128, kernel=4)
NEMOTRON_H = MixerDims("mamba2", heads=128, groups=8, key_dim=128, head_dim=64, kernel=4)


def test_cost_rule():
    links = Links.of_group(64, 8)  # across nodes
    for d in (QWEN3_NEXT, NEMOTRON_H):
        # long documents: the state maps are fixed, the sequence bytes grow with S_l
        assert choose(d, 8, head_traffic(d, 8, 131072, 2), one_document_state_traffic(d, 8, 1, 131072, 2), links) == "state"
        # a short micro-batch inside a node: the head all-to-all moves less than the maps
        near = Links.of_group(8, 8)
        assert choose(d, 8, head_traffic(d, 8, 64, 2), one_document_state_traffic(d, 4, 2, 64, 2), near) == "heads"
    # more ranks than heads: only state passing splits them
    assert choose(QWEN3_NEXT, 64, head_traffic(QWEN3_NEXT, 64, 64, 2), one_document_state_traffic(QWEN3_NEXT, 8, 8, 64, 2),
                  links) == "state"
    import transformers as tf

    assert mixers_of_config(tf.Qwen3NextConfig()) == [(QWEN3_NEXT, 36)]
    (d, n), = mixers_of_config(tf.NemotronHConfig())
    assert (d.kind, d.heads, d.groups, d.key_dim, d.head_dim) == ("mamba2", 128, 8, 128, 64)
    assert mixers_of_config(tf.LlamaConfig()) == []


def _found(*modules):
    return [(f"layers.{i}", m, None) for i, m in enumerate(modules)]


def _gdn_module(v_heads=2, k_heads=1):
    conv = types.SimpleNamespace(kernel_size=(4,))
    return type("Qwen3_5GatedDeltaNet", (), dict(num_v_heads=v_heads, num_k_heads=k_heads, head_k_dim=4, head_v_dim=4,
                                                 conv1d=conv))()


def test_patch_mixers_option_refusals():
    from hf_longctx.integrations.mixers.modes import resolve_modes

    gdn = _gdn_module()
    modes, problems = resolve_modes(_found(gdn), None, (4,))
    assert modes == {"Qwen3_5GatedDeltaNet": "auto"} and not problems
    _, problems = resolve_modes(_found(gdn), "heads", (4,))
    assert "Qwen3_5GatedDeltaNet" in problems[0] and "2 value heads" in problems[0] and "mixers='state'" in problems[0]
    assert not resolve_modes(_found(gdn), "heads", (1, 2))[1]  # every group of the bank has a head per rank
    assert resolve_modes(_found(gdn), {"Qwen3_5GatedDeltaNet": "state"}, (4,))[0] == {"Qwen3_5GatedDeltaNet": "state"}
    _, problems = resolve_modes(_found(gdn), {"BambaMixer": "state"}, (4,))
    assert "BambaMixer" in problems[0]
    rg = type("RecurrentGemmaRecurrentBlock", (), {})()
    assert "no head all-to-all" in resolve_modes(_found(rg), "heads", (2,))[1][0]
    conv = type("Lfm2ShortConv", (), {})()
    assert "no linear recurrence" in resolve_modes(_found(conv), "state", (2,))[1][0]
    with pytest.raises(ValueError, match="mixers must be one of"):
        resolve_modes(_found(gdn), "ring", (2,))


def test_patch_refuses_heads_beyond_the_head_count_before_any_change():
    from hf_longctx.errors import NotSupported
    from hf_longctx.integrations.mixers.registry import plan_mixers
    from tests.helpers.hybrid_models import build

    model = build("qwen3_5_text")  # 4 value heads
    mesh = types.SimpleNamespace(sp=8)
    with pytest.raises(NotSupported, match=r"Qwen3_5GatedDeltaNet: mixers='heads' splits its 4 value heads .* 8 ranks"):
        plan_mixers(model, mesh, option="heads")
    planned, modes = plan_mixers(model, mesh)
    assert len(planned) == 2 and modes == {"Qwen3_5GatedDeltaNet": "auto"}


def test_state_ops_never_sync_the_host(monkeypatch):
    """Meta device, every rank of ring 2 x ulysses 2: no host tensor meets a device op, no
    blocking upload, and the second layer on the same batch uploads nothing."""
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    from hf_longctx.ops.mixers import exchange
    from hf_longctx.ops.mixers.gdn_state import gdn_state_passing
    from hf_longctx.ops.mixers.mamba2_state import mamba2_state_passing
    from tests.helpers.sync_guard import DEV, HostDeviceGuard, fake_all_to_all_v

    def fake_exchange(pieces, recv_shapes, group):
        return [torch.zeros(s, dtype=pieces[0].dtype, device=pieces[0].device) for s in recv_shapes]

    monkeypatch.setattr(exchange, "all_to_all_v", fake_all_to_all_v)
    monkeypatch.setattr(state_passing, "exchange_pieces", fake_exchange)
    lay = SequenceLayout((0, 16, 20, 28, 32), 2, 2)
    leaf = lambda *shape: torch.randn(*shape, device=DEV, requires_grad=True)  # noqa: E731
    for rank in range(lay.sp):
        s = lay.local_length
        for layer in range(2):
            guard = HostDeviceGuard()
            with guard:
                out = gdn_state_passing(
                    leaf(1, s, 2 * 4 + 2 * 4), leaf(1, s, 2), leaf(1, s, 2), conv_weight=leaf(16, 4), conv_bias=None,
                    activation=F.silu, A_log=leaf(2), dt_bias=leaf(2), k_heads=1, head_k_dim=4, head_v_dim=4,
                    core=torch_chunk_gated_delta_rule, varlen=False, lay=lay, rank=rank, group="sp")
                out.sum().backward()
                y = mamba2_state_passing(
                    leaf(1, s, 4 * 3 + 2 * 5), leaf(1, s, 4), conv_weight=leaf(22, 4), conv_bias=leaf(22), activation=F.silu,
                    A_log=leaf(4), D=leaf(4), dt_bias=leaf(4), dt_limit=(0.0, float("inf")), heads=4, groups=1, head_dim=3,
                    state=5, chunk_size=4, scan=mamba2_chunk_scan, lay=lay, rank=rank, group="sp")
                y.sum().backward()
            assert not guard.syncs, f"rank {rank}: {guard.syncs[:5]}"
            if layer:
                assert guard.uploads == 0, f"rank {rank}: the second layer uploaded {guard.uploads} tensors"


def test_planner_charges_the_chosen_scheme(monkeypatch):
    import transformers as tf

    from hf_longctx.capacity import search
    from hf_longctx.capacity.mixers import mixer_schemes, mixer_seconds
    from hf_longctx.capacity.search import Cluster, preset_setting

    cluster = Cluster(gpus=64, gpu_memory=80e9, host_memory=2e12)
    (m,) = mixer_schemes(tf.Qwen3NextConfig(), preset_setting(8, 8, 1, "off"), cluster, 1 << 20)
    assert m.scheme == "state" and m.heads_seconds is None and m.layers == 36  # 64 ranks > 32 value heads
    (n,) = mixer_schemes(tf.NemotronHConfig(), preset_setting(8, 8, 1, "off"), cluster, 1 << 20)
    assert n.scheme == "state" and n.state_seconds < n.heads_seconds
    assert mixer_seconds(tf.LlamaConfig(), preset_setting(8, 1, 1, "off"), cluster, 1 << 15) == 0
    assert mixer_seconds(tf.Qwen3NextConfig(), preset_setting(1, 1, 1, "off"), cluster, 1 << 15) == 0  # no SP
    config = tf.Qwen3NextConfig(num_hidden_layers=8)
    small = Cluster(gpus=8, gpu_memory=80e9, host_memory=2e12)
    with_mixers = {(c.setting, c.preset): c.step_seconds for c in search.rank_settings(config, small, 1 << 16)}
    monkeypatch.setattr(search, "mixer_seconds", lambda *a, **kw: 0.0)
    for c in search.rank_settings(config, small, 1 << 16):
        added = mixer_seconds(config, c.setting, small, 1 << 16)
        assert with_mixers[(c.setting, c.preset)] == pytest.approx(c.step_seconds + added)
