"""One packed-backend exactness case against the dense float64 reference, shared by the backend tests.

Where it sits: test support for tests/unit/test_backends.py (flash-attn, torch's flash ops) and
tests/unit/test_cudnn_backend.py (cuDNN through torch's ops and through cudnn-frontend): the same
three layouts (packed documents, a zigzag ring step, random runs), the same GQA problem, the
forward and a backward whose keys come in two pieces (gradients summed, as a ring or FPDT does).
"""

from __future__ import annotations

import random

import torch

from hf_longctx.layout import ring_stream, runs_to_indices
from hf_longctx.ops import kernels
from tests.helpers.reference import make_runs, random_runs, reference_attention, rel_err

D = 8


def tensors(s, h, hkv, seed, dtype=torch.float64):
    """q, k, v, dout [1, s, heads, D]: h query heads, hkv K/V heads."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, s, n, D, generator=g, dtype=torch.float64).to(dtype) for n in (h, hkv, hkv, h)]


def reference(q, k, v, dout, cu, causal, window, softcap):
    """(out, dq, dk, dv) of the dense float64 reference."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = reference_attention(q, k, v, cu, causal=causal, window=window, softcap=softcap, scale=D**-0.5)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def layout(name):
    """(global boundaries, local query runs, local key runs) of a named layout of 40 tokens."""
    cu = [0, 8, 24, 28, 40]
    if name == "packed":
        return cu, make_runs(cu), make_runs(cu)
    if name == "zigzag":
        return cu, ring_stream(cu, 2, 1), ring_stream(cu, 2, 0) + ring_stream(cu, 2, 1)
    rng = random.Random(5)
    return cu, random_runs(cu, rng), random_runs(cu, rng)


def packed_errors(backend, layout_name, causal, window, softcap, heads=(4, 2)) -> dict[str, float]:
    """Relative errors of out, dq, dk, dv through `backend` against the reference, the keys of the
    backward split in two pieces whose gradients are summed."""
    cu, q_runs, k_runs = layout(layout_name)
    q, k, v, dout = tensors(40, *heads, seed=len(layout_name))
    qi_idx, ki_idx = runs_to_indices(q_runs), runs_to_indices(k_runs)
    dout = torch.zeros_like(dout).index_copy(1, qi_idx, dout[:, qi_idx])
    ref = reference(q, k, v, dout, cu, causal, window, softcap)
    qi, do = (x[:, qi_idx].transpose(1, 2) for x in (q, dout))  # [B, H, Sq, D] local order
    ki, vi = (x[:, ki_idx].transpose(1, 2) for x in (k, v))
    kw = dict(scale=D**-0.5, causal=causal, window=window, softcap=softcap, backend=backend)
    out, lse = kernels.varlen_forward(qi, ki, vi, q_runs, k_runs, **kw)
    half = len(k_runs) // 2
    n0 = sum(r.length for r in k_runs[:half])
    parts = [(k_runs[:half], slice(0, n0)), (k_runs[half:], slice(n0, None))]
    grads = [kernels.varlen_backward(do, qi, ki[:, :, s], vi[:, :, s], out, lse, q_runs, kr, **kw) for kr, s in parts]
    dq = grads[0][0] + grads[1][0]
    dk, dv = torch.cat([grads[0][1], grads[1][1]], 2), torch.cat([grads[0][2], grads[1][2]], 2)
    return {
        "out": rel_err(out.transpose(1, 2), ref[0][:, qi_idx]), "dq": rel_err(dq.transpose(1, 2), ref[1][:, qi_idx]),
        "dk": rel_err(dk.transpose(1, 2), ref[2][:, ki_idx]), "dv": rel_err(dv.transpose(1, 2), ref[3][:, ki_idx]),
    }
