"""All-to-all and ring P2P on gloo: round trips, gradients, mesh groups."""

import pytest
import torch
import torch.distributed as dist

from hf_longctx.distributed import comm
from tests.helpers.pool import worker_mesh


def _mesh_facts(ulysses, ring):
    mesh = worker_mesh(ulysses, ring)
    return (mesh.dp, mesh.dp_rank, mesh.ring_rank, mesh.ulysses_rank, mesh.rank, dist.get_rank(),
            dist.get_process_group_ranks(mesh.ulysses_group), dist.get_process_group_ranks(mesh.ring_group),
            dist.get_process_group_ranks(mesh.sp_group), dist.get_process_group_ranks(mesh.dp_group))


@pytest.mark.parametrize("ulysses,ring", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)])
def test_mesh_groups_ulysses_innermost(pools, ulysses, ring):
    for facts in pools.get(4).run(_mesh_facts, ulysses, ring):
        dp, dp_rank, ring_rank, u_rank, rank, grank, ug, rg, sg, dg = facts
        sp = ulysses * ring
        assert rank == grank and dp == 4 // sp
        assert (dp_rank, ring_rank, u_rank) == (grank // sp, (grank % sp) // ulysses, grank % ulysses)
        assert ug == [dp_rank * sp + ring_rank * ulysses + u for u in range(ulysses)]
        assert rg == [dp_rank * sp + r * ulysses + u_rank for r in range(ring)]
        assert sg == list(range(dp_rank * sp, (dp_rank + 1) * sp))
        assert dg == [d * sp + ring_rank * ulysses + u_rank for d in range(dp)]


def _a2a_roundtrip(ulysses, heads):
    mesh = worker_mesh(ulysses, 1)
    g = torch.Generator().manual_seed(0)
    # Global tensors, identical on every rank; each rank holds its contiguous sequence piece.
    full = [torch.randn(2, 4 * ulysses, h, 3, generator=g, dtype=torch.float64) for h in heads]
    u = mesh.ulysses_rank
    local = [t[:, 4 * u : 4 * (u + 1)].clone().requires_grad_() for t in full]
    moved = comm.all_to_all_seq_to_head(*local, group=mesh.ulysses_group)
    for t, m in zip(full, moved):
        h = t.shape[2] // ulysses
        torch.testing.assert_close(m, t[:, :, u * h : (u + 1) * h])  # [B, U·S_local, Hx/U, D]: all tokens, my heads
    back = comm.all_to_all_head_to_seq(*moved, group=mesh.ulysses_group)
    for loc, b in zip(local, back):
        torch.testing.assert_close(b, loc)
    # d/dx of sum(w_rank * f(x)): head slice j of my piece went to rank j, so its gradient is rank j's
    # weights at my sequence rows. Rank-dependent weights make a mis-routed gradient visible.
    def weights(rank, m):
        return torch.arange(m.numel(), dtype=torch.float64).reshape(m.shape) + 1000.0 * rank

    sum((weights(u, m) * m).sum() for m in moved).backward()
    for t, loc, m in zip(full, local, moved):
        expect = torch.cat([weights(j, m)[:, 4 * u : 4 * (u + 1)] for j in range(ulysses)], dim=2)
        torch.testing.assert_close(loc.grad, expect)
    return True


@pytest.mark.parametrize("ulysses", [2, 4])
def test_all_to_all_roundtrip_and_grad(pools, ulysses):
    assert all(pools.get(4).run(_a2a_roundtrip, ulysses, [8, 4, 4]))


def _ring_shift(ring):
    mesh = worker_mesh(1, ring)
    ex = comm.RingExchanger(
        mesh.ring_group, mesh.global_rank(ring_rank=mesh.ring_rank + 1), mesh.global_rank(ring_rank=mesh.ring_rank - 1)
    )
    t = torch.full((3,), float(mesh.ring_rank))
    ex.start(t)
    got = ex.wait()
    return got[0].item(), mesh.ring_rank


@pytest.mark.parametrize("ring", [2, 4])
def test_ring_exchanger_receives_from_previous(pools, ring):
    for got, r in pools.get(4).run(_ring_shift, ring):
        assert got == (r - 1) % ring
