"""The mesh without torch.distributed, degree validation, and layout properties."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_longctx import init_sequence_parallel
from hf_longctx import layout
from hf_longctx.distributed.mesh import check_degrees


def test_single_process_mesh_is_identity():
    mesh = init_sequence_parallel()
    assert (mesh.dp, mesh.ring, mesh.ulysses, mesh.sp, mesh.rank) == (1, 1, 1, 1, 0)
    assert mesh.doc_multiple == 1 and mesh.seq_multiple == 1
    torch.testing.assert_close(mesh.local_indices([0, 3, 7]), torch.arange(7))


@pytest.mark.parametrize(
    "world,u,r,f,needle",
    [
        (6, 4, 2, 1, "ulysses(4) x ring(2) = 8 does not divide world size 6"),
        (1, 2, 1, 1, "ulysses(2) x ring(1) = 2 does not divide world size 1"),
        (4, 2, 2, 2, "fpdt_chunks(2) > 1 needs ring_degree 1 (got ring 2)"),
        (4, 0, 1, 1, "ulysses_degree must be a positive int, got 0"),
    ],
)
def test_degree_errors_name_every_factor(world, u, r, f, needle):
    with pytest.raises(ValueError) as e:
        check_degrees(world, u, r, f)
    assert needle in str(e.value)


def test_boundary_errors_name_documents():
    with pytest.raises(ValueError, match=r"doc_multiple = 2 x ring = 4: document 1 has length 6"):
        layout.check_boundaries([0, 8, 14], ring=2, ulysses=1)
    with pytest.raises(ValueError, match=r"packed length 12 is not a multiple of seq_multiple = 8"):
        layout.check_boundaries([0, 4, 12], ring=2, ulysses=4)


def test_zigzag_matches_definition():
    # One document of 16 tokens, R = 2, U = 2: ring rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    cu = [0, 16]
    idx = {
        (r, u): layout.local_indices(cu, ring=2, ulysses=2, ring_rank=r, ulysses_rank=u).tolist()
        for r in range(2) for u in range(2)
    }
    assert idx[(0, 0)] == [0, 1, 2, 3] and idx[(0, 1)] == [12, 13, 14, 15]
    assert idx[(1, 0)] == [4, 5, 6, 7] and idx[(1, 1)] == [8, 9, 10, 11]


def test_fpdt_rank_ordinal_chunks():
    # S = 16, U = 2, u = 2: 4 pieces of 4; rank j holds pieces j and 2 + j.
    a = layout.local_indices([0, 16], ring=1, ulysses=2, ring_rank=0, ulysses_rank=0, fpdt_chunks=2).tolist()
    b = layout.local_indices([0, 16], ring=1, ulysses=2, ring_rank=0, ulysses_rank=1, fpdt_chunks=2).tolist()
    assert a == [0, 1, 2, 3, 8, 9, 10, 11] and b == [4, 5, 6, 7, 12, 13, 14, 15]


@st.composite
def packed(draw):
    ring = draw(st.sampled_from([1, 2, 4]))
    ulysses = draw(st.sampled_from([1, 2, 4]))
    fpdt = draw(st.sampled_from([1, 2, 4])) if ring == 1 else 1
    dm = layout.doc_multiple(ring) if fpdt == 1 else 1
    docs = draw(st.lists(st.integers(1, 6), min_size=1, max_size=6))
    lengths = [n * dm for n in docs]
    sm = layout.seq_multiple(ring, ulysses, fpdt)
    pad = (-sum(lengths)) % sm
    if pad:
        lengths.append(pad)  # the trailing padding document, as shard_batch adds it
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu, ring, ulysses, fpdt


@settings(max_examples=150, deadline=None)
@given(packed())
def test_local_indices_cover_every_token_once(args):
    cu, ring, ulysses, fpdt = args
    parts = [
        layout.local_indices(cu, ring=ring, ulysses=ulysses, ring_rank=r, ulysses_rank=u, fpdt_chunks=fpdt)
        for r in range(ring) for u in range(ulysses)
    ]
    assert len({len(p) for p in parts}) == 1  # every SP rank holds the same count
    perm = torch.cat(parts)
    assert sorted(perm.tolist()) == list(range(cu[-1]))  # each token exactly once
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(len(perm))
    x = torch.arange(cu[-1]) * 7
    torch.testing.assert_close(x[perm][inverse], x)  # the inverse restores the global order


@pytest.mark.parametrize("dp,ring,ulysses,fpdt,rank", [(1, 1, 1, 1, 0), (2, 2, 2, 1, 5), (4, 1, 2, 2, 7), (2, 4, 1, 1, 6)])
def test_a_mesh_answers_as_a_bank_of_its_one_size(dp, ring, ulysses, fpdt, rank):
    """Every question a caller asks a GroupBank, asked of an SPMesh, gets the answer of a
    bank holding that mesh as its only group (built by hand: no process group needed)."""
    from hf_longctx.distributed.mesh import SPMesh
    from hf_longctx.flex.bank import GroupBank

    sp = ring * ulysses
    mesh = SPMesh(dp=dp, ring=ring, ulysses=ulysses, fpdt_chunks=fpdt, dp_rank=rank // sp,
                  ring_rank=(rank % sp) // ulysses, ulysses_rank=rank % ulysses)
    assert mesh.rank == rank
    bank = GroupBank(world_size=mesh.world_size, rank=rank, shapes=mesh.shapes, meshes=(mesh,))
    assert mesh.sizes == bank.sizes == (sp,)
    assert (mesh.min_size, mesh.max_size) == (bank.min_size, bank.max_size) == (sp, sp)
    assert mesh.shape(sp) == bank.shape(sp)
    assert (mesh.shape(sp).ulysses, mesh.shape(sp).ring, mesh.shape(sp).fpdt_chunks) == (ulysses, ring, fpdt)
    assert (mesh.shape(sp).doc_multiple, mesh.shape(sp).seq_multiple) == (mesh.doc_multiple, mesh.seq_multiple)
    assert mesh.mesh(sp) is bank.mesh(sp) is mesh
    assert mesh.group_index(sp) == bank.group_index(sp) == rank // sp
    assert mesh.world is bank.world is mesh and mesh.patch_mesh is bank.patch_mesh is mesh
    for other in (2 * sp, sp + 1):
        for ask in (mesh.shape, mesh.mesh, mesh.group_index, bank.mesh):
            with pytest.raises(ValueError, match=f"no group of size {other}"):
                ask(other)


def test_both_kinds_of_mesh_are_a_mesh_and_a_mesh_is_a_rank_layout():
    """`Mesh` (distributed/mesh_protocol.py) is what SPMesh and GroupBank both answer; `RankLayout`
    (layout.py) is what the data stage reads of an SPMesh."""
    from hf_longctx.distributed.mesh import SPMesh
    from hf_longctx.distributed.mesh_protocol import Mesh
    from hf_longctx.flex.bank import GroupBank

    mesh = SPMesh(dp=2, ring=2, ulysses=2, fpdt_chunks=1, dp_rank=1, ring_rank=0, ulysses_rank=1)
    bank = GroupBank(world_size=mesh.world_size, rank=mesh.rank, shapes=mesh.shapes, meshes=(mesh,))
    assert isinstance(mesh, Mesh) and isinstance(bank, Mesh)
    assert isinstance(mesh, layout.RankLayout) and not isinstance(bank, layout.RankLayout)


def _protocol_members(cls) -> set[str]:
    return {n for n in vars(cls) if not n.startswith("_")}


@pytest.mark.parametrize("protocol, owners", [
    ("hf_longctx.distributed.mesh_protocol.Mesh",
     ("distributed/mesh.py", "distributed/mesh_protocol.py", "flex/bank.py")),
    ("hf_longctx.layout.RankLayout", ("distributed/mesh.py", "layout.py")),
])
def test_every_member_of_a_mesh_protocol_is_read_by_a_consumer(protocol, owners):
    """A protocol holds exactly what its consumers read: each member is read (`x.member`) in
    some module of the package other than the protocol's and its implementations'."""
    import ast
    import importlib
    import pathlib

    module, name = protocol.rsplit(".", 1)
    members = _protocol_members(getattr(importlib.import_module(module), name))
    root = pathlib.Path(__file__).resolve().parents[2] / "hf_longctx"
    read = set()
    for path in root.rglob("*.py"):
        if path.relative_to(root).as_posix() in owners:
            continue
        read |= {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}
    assert members and members <= read, f"{name} members no consumer reads: {sorted(members - read)}"
