"""Ring attention keeps ONE copy of K/V for the backward (`ops/ring.RingAttention`).

After the Ulysses all-to-all, q, k and v are views of one receive buffer, which the saved q
keeps alive; the ring then saves k and v as those views, not the packed K/V it sends (a
second copy of the same bytes per layer). Without a shared buffer (ring only) it saves the
packed K/V it already made, and the backward does not pack again. The gradients are the
same either way (checked against one process in test_usp.py; here the two saving modes
against each other, bit for bit).
"""

from __future__ import annotations

import torch

from tests.helpers.pool import worker_mesh


def _ring_node(out: torch.Tensor):
    todo, seen = [out.grad_fn], {}  # id -> node: kept alive, so no id of a freed node wrapper is reused
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        if "RingAttention" in type(node).__name__:
            return node
        todo += [n for n, _ in node.next_functions]
    raise AssertionError("no RingAttention node in the graph")


def _saved(ulysses: int, ring: int, fused: bool):
    from hf_longctx.ops.usp import usp_attention

    mesh = worker_mesh(ulysses, ring)
    g = torch.Generator().manual_seed(mesh.sp_rank)
    h, hkv, d, s_local = 4, 2, 8, 8
    qkv = torch.randn(1, s_local, h + 2 * hkv, d, generator=g, requires_grad=True)
    if fused:  # one projection output, split: q, k, v share its storage
        q, k, v = qkv.split([h, hkv, hkv], dim=2)
    else:  # the same values in three tensors of their own
        q, k, v = (t.detach().clone().requires_grad_() for t in qkv.split([h, hkv, hkv], dim=2))
    total = s_local * mesh.sp
    out = usp_attention(q, k, v, mesh, cu_seqlens=[0, total - 8, total])  # two packed documents
    node = _ring_node(out)
    q_s, k_s, v_s, kv_s, *_ = node.saved_tensors
    kinds = {
        "k, v": k_s is not None and v_s is not None,
        "k, v share q's storage": k_s is not None and k_s.untyped_storage().data_ptr() == q_s.untyped_storage().data_ptr(),
        "packed": kv_s is not None,
    }
    out.backward(torch.ones_like(out))
    grads = qkv.grad if fused else torch.cat([q.grad, k.grad, v.grad], dim=2)  # [1, S_local, H + 2·H_kv, D]
    return kinds, grads


def test_after_ulysses_only_the_receive_buffer_holds_k_and_v(pools):
    for kinds, _ in pools.get(4).run(_saved, 2, 2, False):
        assert kinds == {"k, v": True, "k, v share q's storage": True, "packed": False}, kinds


def test_ring_only_saves_the_packed_copy_it_sent(pools):
    separate = pools.get(2).run(_saved, 1, 2, False)
    fused = pools.get(2).run(_saved, 1, 2, True)
    for (kinds, g_sep), (kinds_fused, g_fused) in zip(separate, fused):
        assert kinds == {"k, v": False, "k, v share q's storage": False, "packed": True}, kinds
        assert kinds_fused == {"k, v": True, "k, v share q's storage": True, "packed": False}, kinds_fused
        assert torch.equal(g_sep, g_fused)  # the same gradients whichever copy the backward reads
