"""One distributed-attention test case against the float64 single-process reference.

Shared by the USP and FPDT equivalence tests: build a seeded global problem (q, k, v and
an upstream gradient, identical on every rank of a DP group), run the dense float64
reference forward and backward, run the distributed attention on this rank's rows
(`mesh.local_indices`), and return the relative error max|a-b|/max|b| of the output and
of dq/dk/dv at those rows. With `case["sinks"]` the attention also gets per-head sink
logits (a parameter replicated on every rank, as HF's `s_aux`): its gradient, summed over
the SP group as every parameter gradient is, is compared as "dsink". For bf16 the same errors of single-process bf16 attention are
returned too (`base_*`), the budget the distributed version is held to.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from tests.helpers.reference import make_runs, reference_attention, rel_err


def case_errors(
    mesh,
    case: dict,
    dtype: torch.dtype,
    *,
    attention: Callable,
    cu: list[int] | None,
    rows: tuple[int, int],
    head_dim: int,
    variants: dict[str, dict] | None = None,
) -> dict[str, float]:
    """`cu`: packed boundaries (B = 1) or None with `rows` = (B, S) of one document each.
    `attention(q, k, v, mesh, cu_seqlens=..., causal=..., window=..., softcap=..., **variant)`
    runs once per entry of `variants` (error names prefixed by its key)."""
    seed = case.get("seed", 0) + 1000 * mesh.dp_rank  # different DP groups solve different problems
    g = torch.Generator().manual_seed(seed)
    h, hkv = case["heads"], case["kv_heads"]
    b, s = (1, cu[-1]) if cu else rows
    q = torch.randn(b, s, h, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(b, s, hkv, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(b, s, hkv, head_dim, generator=g, dtype=torch.float64)
    dout = torch.randn(b, s, h, head_dim, generator=g, dtype=torch.float64)
    kw = dict(causal=case.get("causal", True), window=case.get("window"), softcap=case.get("softcap"))
    cu_ref = torch.tensor(cu) if cu else None
    # Sinks around the rows' log-normalisers (~log of the keys seen), so that they matter:
    # far below, they would vanish; far above, they would swamp every row.
    sinks = 1.5 + torch.randn(h, generator=g, dtype=torch.float64) if case.get("sinks") else None

    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_sinks = sinks.clone().requires_grad_() if sinks is not None else None
    ref_out = reference_attention(*ref_in, cu_ref, **kw, sinks=ref_sinks)
    ref_out.backward(dout)

    idx = mesh.local_indices(cu if cu else [0, s])  # [S_local] rows this rank holds
    errs = {}
    for tag, variant in (variants or {"": {}}).items():
        local = [t[:, idx].to(dtype).requires_grad_() for t in (q, k, v)]
        cu_t = torch.tensor(cu, dtype=torch.int32) if cu else None
        extra = {}
        if sinks is not None:
            extra["sinks"] = local_sinks = sinks.to(dtype).requires_grad_()
        out = attention(*local, mesh, cu_seqlens=cu_t, **kw, **variant, **extra)
        out.backward(dout[:, idx].to(dtype))
        errs[tag + "out"] = rel_err(out.double(), ref_out[:, idx].detach())
        errs[tag + "contiguous"] = 0.0 if out.is_contiguous() else 1.0  # HF models .view() the output
        for name, t, r in zip(("dq", "dk", "dv"), local, ref_in):
            errs[tag + name] = rel_err(t.grad.double(), r.grad[:, idx])
        if sinks is not None:
            dsink = local_sinks.grad.double()
            if mesh.sp > 1:  # each rank holds the gradient of its own heads and rows
                dist.all_reduce(dsink, group=mesh.sp_group)
            errs[tag + "dsink"] = rel_err(dsink, ref_sinks.grad)
    if dtype == torch.bfloat16:
        base = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        base_sinks = sinks.to(dtype).requires_grad_() if sinks is not None else None
        bout = reference_attention(*base, cu_ref, **kw, sinks=base_sinks)
        bout.backward(dout.to(dtype))
        errs["base_out"] = rel_err(bout[:, idx].double(), ref_out[:, idx].detach())
        for name, t, r in zip(("dq", "dk", "dv"), base, ref_in):
            errs["base_" + name] = rel_err(t.grad[:, idx].double(), r.grad[:, idx])
        if sinks is not None:
            errs["base_dsink"] = rel_err(base_sinks.grad.double(), ref_sinks.grad)
    return errs


def rounding_mismatch(mesh, attention, cu: list[int], *, softcap: float = 5.0, heads: int = 4, head_dim: int = 16) -> dict:
    """Fraction of this rank's bf16 outputs/gradients that differ from the correctly rounded
    float64 value of the same computation: 0 up to rare ties when the distributed
    attention rounds once, a large fraction when partial results are rounded to bf16
    before the merge. `softcap` sends every tile to the math kernel, which returns its
    partials unrounded (the fused CPU op rounds inside and cannot be tested this way).

    The truth: forward, the dense float64 reference on the bf16 inputs; backward, the
    FlashAttention-2 backward in float64 from the bf16 output every rank saved (gathered:
    dk/dv of a rank's keys depend on every rank's rows) -- the gradient a single rounding
    of the distributed backward must reproduce."""
    from hf_longctx.ops import kernels

    g = torch.Generator().manual_seed(0)
    s = cu[-1]
    q, k, v, dout = (torch.randn(1, s, heads, head_dim, generator=g).bfloat16() for _ in range(4))  # [1, S, H, D]
    idx = mesh.local_indices(cu)
    local = [t[:, idx].requires_grad_() for t in (q, k, v)]
    out = attention(*local, mesh, cu_seqlens=cu, softcap=softcap)
    out.backward(dout[:, idx])
    full = torch.empty_like(q)  # [1, S, H, D]: every rank's bf16 output, in global order
    if mesh.sp > 1:
        outs, idxs = [torch.empty_like(out) for _ in range(mesh.sp)], [torch.empty_like(idx) for _ in range(mesh.sp)]
        dist.all_gather(outs, out.detach().contiguous(), group=mesh.sp_group)
        dist.all_gather(idxs, idx, group=mesh.sp_group)
        for o, i in zip(outs, idxs):
            full[:, i] = o
    else:
        full[:, idx] = out.detach()
    ref_out = reference_attention(q.double(), k.double(), v.double(), cu, softcap=softcap)
    heads_first = lambda t: t.double().transpose(1, 2)  # [1, H, S, D], the kernel layout
    runs = make_runs(cu)
    kw = dict(scale=head_dim**-0.5, causal=True, softcap=softcap)
    _, lse = kernels.varlen_forward(heads_first(q), heads_first(k), heads_first(v), runs, runs, **kw)
    grads = kernels.varlen_backward(
        heads_first(dout), heads_first(q), heads_first(k), heads_first(v), heads_first(full), lse, runs, runs, **kw
    )
    fractions = {"out": (out != ref_out[:, idx].bfloat16()).float().mean().item()}
    for name, t, r in zip(("dq", "dk", "dv"), local, grads):
        fractions[name] = (t.grad != r.transpose(1, 2)[:, idx].bfloat16()).float().mean().item()
    return fractions
