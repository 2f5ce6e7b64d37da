"""Multi-process USP attention demo: 4 gloo ranks, Ulysses 2 x ring 2, packed documents, GQA.

Run: python -m torch.distributed.run --nproc-per-node 4 recipes/attention_demo.py
Each rank holds its zigzag/Ulysses rows of a packed sequence of documents; the script runs
`hf_longctx.usp_attention` forward and backward and prints, on rank 0, the relative error of
the output and of dq/dk/dv against a dense single-process float64 reference.
"""

import math

import torch
import torch.distributed as dist

import hf_longctx


def dense_reference(q, k, v, cu):
    """[1, S, H, D] float64 causal attention with a block-diagonal document mask."""
    s, h, hkv = q.shape[1], q.shape[2], k.shape[2]
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
    pos = torch.arange(s)
    allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])  # [S, S]
    k, v = (t.repeat_interleave(h // hkv, dim=2) for t in (k, v))
    scores = torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(q.shape[-1])
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("bhst,bthd->bshd", probs, v)


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = hf_longctx.init_sequence_parallel(ulysses_degree=2, ring_degree=2)
    g = torch.Generator().manual_seed(0)
    lengths = [24, 8, 52, 12]  # multiples of doc_multiple = 4; total a multiple of seq_multiple
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    s, h, hkv, d = cu[-1], 8, 2, 32
    q, k, v, dout = (torch.randn(1, s, n, d, generator=g, dtype=torch.float64) for n in (h, hkv, hkv, h))

    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = dense_reference(*ref, cu)
    ref_out.backward(dout)

    idx = mesh.local_indices(cu)  # the global rows this rank holds
    local = [t[:, idx].float().requires_grad_() for t in (q, k, v)]
    out = hf_longctx.usp_attention(*local, mesh, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    out.backward(dout[:, idx].float())

    def rel(a, b):
        return ((a.double() - b).abs().max() / b.abs().max()).item()

    errs = torch.tensor(
        [rel(out, ref_out[:, idx].detach())] + [rel(t.grad, r.grad[:, idx]) for t, r in zip(local, ref)],
        dtype=torch.float64,
    )
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(f"USP attention: world {mesh.world_size} = dp {mesh.dp} x ring {mesh.ring} x ulysses {mesh.ulysses}")
        print(f"packed documents {lengths}, H={h}, H_kv={hkv}, D={d}, fp32 vs float64 dense reference")
        print(f"{'tensor':8s} {'max rel err over ranks':>24s}")
        for name, e in zip(("out", "dq", "dk", "dv"), errs.tolist()):
            print(f"{name:8s} {e:24.2e}")
        print("OK" if errs.max() <= 2e-5 else "MISMATCH")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
