"""The attention backends' exactness cases and kernel timings, run inside one bounded worker each.

Where it sits: the worker half of `benchmarks/gpu_attention_backends.py` (one subprocess per
backend, so a hang or a crash ends only that backend's rows, and torch's process-wide FA3 switch
stays inside its own process). Exactness: each case runs the backend through
`ops/kernels.varlen_forward/backward` -- the path the ring and FPDT take -- and compares out, lse,
dq, dk, dv with the math kernel on float32 copies of the same bf16 inputs, at the tolerances of
tests/gpu/test_kernels_cuda.py (a wrong mask or alignment changes whole rows). The cases are the
shapes the code runs: packed documents longer than the head dim, GQA 32/8, zigzag ring blocks
(own keys and a peer's), FPDT chunk pairs, windows, K/V as strided views of one buffer. Timing:
causal single-document forward and backward, TFLOP/s = 4 (10) x pairs x H x D / seconds, the
FLOPs `capacity/gpus.py`'s fractions count."""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from hf_longctx.layout import ring_stream, runs_of_range, runs_to_indices
from hf_longctx.ops import kernels
from hf_longctx.ops.backends import select
from hf_longctx.ops.backends.capabilities import refusal
from tests.helpers.reference import make_runs, rel_err

TOL = 2e-2  # bf16, as tests/gpu/test_kernels_cuda.py: out 2e-2, gradients 2 x 2e-2


class Case(NamedTuple):
    name: str
    cu: list
    q_runs: list
    k_runs: list
    heads: tuple  # (H, H_kv)
    window: int | None = None
    strided_kv: bool = False  # K and V as views of one [T, 2, H_kv, D] buffer (the Ulysses receive buffer's layout)


def cases(tokens: int, heads: tuple) -> list[Case]:
    """The exactness cases over `tokens` tokens: documents of ~1/15, ~6/15, 1 and the rest."""
    t = tokens
    cu = [0, t // 15, t // 15 + 6 * t // 15, t // 15 + 6 * t // 15 + 1, t]
    chunk = t // 4
    return [
        Case("packed documents", cu, make_runs(cu), make_runs(cu), heads),
        Case("ring step 0 (own zigzag keys)", cu, ring_stream(cu, 2, 1), ring_stream(cu, 2, 1), heads),
        Case("ring step 1 (a peer's keys)", cu, ring_stream(cu, 2, 1), ring_stream(cu, 2, 0), heads),
        Case("FPDT chunk 2 over chunk 2", cu, runs_of_range(cu, 2 * chunk, 3 * chunk), runs_of_range(cu, 2 * chunk, 3 * chunk), heads),
        Case("FPDT chunk 3 over chunks 0-2", cu, runs_of_range(cu, 3 * chunk, t), runs_of_range(cu, 0, 3 * chunk), heads),
        Case("window t/16, packed", cu, make_runs(cu), make_runs(cu), heads, window=max(2, t // 16)),
        Case("K/V strided views", cu, make_runs(cu), make_runs(cu), heads, strided_kv=True),
    ]


def exact(backend, case: Case, head_dim: int, device, dtype=torch.bfloat16) -> dict:
    """Errors of `backend` against the math kernel in float32 for one case (causal), or why skipped."""
    why = refusal(backend.name.split("[")[0], device="cuda", dtype=dtype,
                  head_dim=head_dim, softcap=None, window=case.window)
    if why is not None:
        return {"case": case.name, "skipped": why}
    h, hkv = case.heads
    g = torch.Generator(device=device).manual_seed(len(case.name))
    nq, nk = len(runs_to_indices(case.q_runs)), len(runs_to_indices(case.k_runs))
    q, dout = (torch.randn(1, nq, h, head_dim, device=device, generator=g, dtype=dtype) for _ in range(2))
    if case.strided_kv:
        kv = torch.randn(1, nk, 2, hkv, head_dim, device=device, generator=g, dtype=dtype)
        k, v = kv[:, :, 0], kv[:, :, 1]  # [1, S, H_kv, D] views, token stride 2·H_kv·D
    else:
        k, v = (torch.randn(1, nk, hkv, head_dim, device=device, generator=g, dtype=dtype) for _ in range(2))
    q, k, v, dout = (x.transpose(1, 2) for x in (q, k, v, dout))  # [B, H, S, D] views of token-major memory
    kw = dict(scale=head_dim**-0.5, causal=True, window=case.window, softcap=None)
    ref = [x.float() for x in (q, k, v, dout)]
    m_out, m_lse = kernels.varlen_forward(*ref[:3], case.q_runs, case.k_runs, backend=select.MATH, **kw)
    m_grads = kernels.varlen_backward(ref[3], *ref[:3], m_out, m_lse, case.q_runs, case.k_runs, backend=select.MATH, **kw)
    out, lse = kernels.varlen_forward(q, k, v, case.q_runs, case.k_runs, backend=backend, **kw)
    grads = kernels.varlen_backward(dout, q, k, v, out, lse, case.q_runs, case.k_runs, backend=backend, **kw)
    errors = {"out": rel_err(out.float(), m_out), "lse": (lse.float() - m_lse).abs().max().item()}
    errors.update({f"d{n}": rel_err(gr.float(), m) for n, gr, m in zip("qkv", grads, m_grads)})
    ok = errors["out"] < TOL and errors["lse"] < 1e-2 and all(errors[f"d{n}"] < 2 * TOL for n in "qkv")
    return {"case": case.name, "exact": ok, **{k_: round(v_, 6) for k_, v_ in errors.items()}}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def speed(backend, tokens: int, heads: tuple, head_dim: int, device, repeat: int = 1, dtype=torch.bfloat16) -> dict:
    """Forward and backward TFLOP/s of one causal document: the best of `repeat` after one warm-up
    (`repeat=0`: the warm-up alone, for lengths whose plans the shorter ones did not build)."""
    h, hkv = heads
    g = torch.Generator(device=device).manual_seed(0)
    q, dout = (torch.randn(1, tokens, h, head_dim, device=device, generator=g, dtype=dtype).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(1, tokens, hkv, head_dim, device=device, generator=g, dtype=dtype).transpose(1, 2) for _ in range(2))
    runs = make_runs([0, tokens])
    kw = dict(scale=head_dim**-0.5, causal=True, window=None, softcap=None, backend=backend)
    times = {"forward": [], "backward": []}
    for _ in range(repeat + 1):
        _sync(device)
        t0 = time.perf_counter()
        out, lse = kernels.varlen_forward(q, k, v, runs, runs, **kw)
        _sync(device)
        t1 = time.perf_counter()
        kernels.varlen_backward(dout, q, k, v, out, lse, runs, runs, **kw)
        _sync(device)
        times["forward"].append(t1 - t0)
        times["backward"].append(time.perf_counter() - t1)
        del out, lse
    pairs = tokens * (tokens + 1) / 2
    row = {"tokens": tokens, "heads": h, "kv_heads": hkv, "head_dim": head_dim}
    for part, factor in (("forward", 4), ("backward", 10)):
        seconds = min(times[part][1:] or times[part])  # the first call builds plans (cuDNN graphs), unless it is the only one
        row[f"{part}_s"] = round(seconds, 6)
        row[f"{part}_tflops"] = round(factor * pairs * h * head_dim / seconds / 1e12, 3)
    return row
