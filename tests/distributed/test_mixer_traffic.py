"""The linear mixers' cost rule against the bytes counted on the wire, per rank, both schemes.

`ops/mixers/cost.py` prices one layer (forward + backward) for the rule `patch(mixers="auto")`
applies and the planner charges. Here one Gated DeltaNet and one Mamba-2 layer core
(tiny fp32 sizes; the recurrence replaced by a stand-in of the kernel's shapes and graph edges:
the bytes on the wire do not depend on it) run forward and backward on 2 and 4 gloo ranks
over three layouts / document sets, every `all_to_all_single` intercepted and the bytes a
rank sends to OTHER ranks summed (`benchmarks/mixers.CountSent`). State passing: the rule's
bytes (`layout_state_traffic`: the forward scan, the backward's REVERSE scan, halo rows out and
halo gradients back) equal the counted bytes on every rank, exactly. The head all-to-all:
`head_traffic` is exact for one document per row split evenly (its stated case).
A rule that charges the backward as a copy of the forward fails here (checked once).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.pool import worker_mesh

GDN = dict(hk=2, hv=4, dk=8, dv=8, k=4)
M2 = dict(h=4, g=2, n=8, p=8, k=4)


def _core(q, k, v, g, beta, initial_state=None, output_final_state=False, **_):
    """The GDN kernel's shapes and graph edges, no recurrence."""
    out = v * beta[..., None] + (q * k).sum() * 0
    return out, (initial_state + g.sum() * 0 if output_final_state else None)


def _scan(x, dt, A, B, C, chunk_size, D=None, return_final_states=False, **_):
    """The SSD scan's shapes and graph edges, no recurrence."""
    y = x.float() * D[:, None] + (dt.sum() + B.sum() + C.sum()) * 0
    if not return_final_states:
        return y
    return y, y.new_zeros(x.shape[0], x.shape[2], x.shape[3], B.shape[-1]) + y.sum() * 0


def _run(kind: str, scheme: str, ulysses: int, ring: int, cu: tuple) -> dict:
    import torch.distributed as dist

    from benchmarks.mixers import CountSent
    from hf_longctx.ops.mixers.cost import MixerDims, head_traffic, layout_state_traffic
    from hf_longctx.ops.mixers.gdn import GDNHeads, gdn_sequence_parallel
    from hf_longctx.ops.mixers.gdn_state import gdn_state_passing
    from hf_longctx.ops.mixers.layout import SequenceLayout
    from hf_longctx.ops.mixers.mamba2 import Mamba2Heads, mamba2_sequence_parallel
    from hf_longctx.ops.mixers.mamba2_state import mamba2_state_passing

    mesh = worker_mesh(ulysses, ring)
    lay = SequenceLayout(cu, ring, ulysses)
    s_l, rank, group = lay.local_length, mesh.sp_rank, mesh.sp_group
    g = torch.Generator().manual_seed(rank)
    leaf = lambda *shape: torch.randn(*shape, generator=g).requires_grad_()  # noqa: E731
    common = dict(activation=F.silu, lay=lay, rank=rank, group=group)
    if kind == "gdn":
        c = GDN
        dims = MixerDims("gdn", c["hv"], c["hk"], c["dk"], c["dv"], c["k"])
        conv = 2 * c["hk"] * c["dk"] + c["hv"] * c["dv"]
        ins = [leaf(1, s_l, conv), torch.rand(1, s_l, c["hv"], generator=g).requires_grad_(), leaf(1, s_l, c["hv"])]
        kw = dict(conv_weight=torch.randn(conv, c["k"], generator=g), conv_bias=None, A_log=torch.zeros(c["hv"]),
                  dt_bias=torch.zeros(c["hv"]), head_k_dim=c["dk"], head_v_dim=c["dv"], core=_core, **common)
        with CountSent(dist.get_rank()) as sent:
            if scheme == "state":
                out = gdn_state_passing(*ins, k_heads=c["hk"], varlen=False, **kw)
            else:
                out = gdn_sequence_parallel(*ins, heads=GDNHeads.split(c["hk"], c["hv"], lay.sp), **kw)
            torch.autograd.grad(out.square().sum(), ins)
    else:
        c = M2
        dims = MixerDims("mamba2", c["h"], c["g"], c["n"], c["p"], c["k"])
        conv = c["h"] * c["p"] + 2 * c["g"] * c["n"]
        ins = [leaf(1, s_l, conv), leaf(1, s_l, c["h"])]
        kw = dict(conv_weight=torch.randn(conv, c["k"], generator=g), conv_bias=None, A_log=torch.zeros(c["h"]),
                  D=torch.ones(c["h"]), dt_bias=torch.zeros(c["h"]), dt_limit=(0.0, float("inf")), head_dim=c["p"],
                  state=c["n"], chunk_size=8, scan=_scan, **common)
        with CountSent(dist.get_rank()) as sent:
            if scheme == "state":
                out = mamba2_state_passing(*ins, heads=c["h"], groups=c["g"], **kw)
            else:
                out = mamba2_sequence_parallel(*ins, heads=Mamba2Heads.split(c["h"], c["g"], lay.sp), **kw)
            torch.autograd.grad(out.square().sum(), ins)
    rule = layout_state_traffic(dims, lay, rank, 4) if scheme == "state" else head_traffic(dims, lay.sp, s_l, 4)
    return {"counted": sent.bytes, "rule": rule.bytes}


CASES = [  # (ulysses, ring, documents): packed Ulysses, one document over 4, zigzag packed
    (2, 1, (0, 40, 48, 64)),
    (4, 1, (0, 128)),
    (2, 2, (0, 24, 80, 96, 128)),
]


@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
def test_state_passing_rule_equals_counted_bytes(pools, kind):
    for u, r, cu in CASES:
        for rank, res in enumerate(pools.get(u * r).run(_run, kind, "state", u, r, cu, timeout=300)):
            assert res["rule"] == res["counted"], (kind, u, r, cu, rank, res)


@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
def test_head_rule_equals_counted_bytes(pools, kind):
    for u, r, cu in [(2, 1, (0, 64))]:
        for rank, res in enumerate(pools.get(u * r).run(_run, kind, "heads", u, r, cu, timeout=300)):
            assert res["rule"] == res["counted"], (kind, u, r, cu, rank, res)
