"""Overhead of the local attention kernels over the raw aten CPU flash op.

Where it sits: measures `ops/kernels.py` (varlen_forward + varlen_backward: planning,
slicing, lse fix-ups, merges) against the bare
`_scaled_dot_product_flash_attention_for_cpu` forward + backward pair on the same
shapes: one causal document (one aten call each way), and packed documents (against one
raw aten call per document on pre-sliced contiguous tensors, the cheapest possible
varlen on CPU). Medians over interleaved repetitions, one thread.

Run: python benchmarks/local_kernel.py [--seq 4096] [--heads 8] [--dim 64] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_longctx.layout import Run
from hf_longctx.ops.kernels import varlen_backward, varlen_forward

FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _raw_step(pieces, scale):
    """Raw aten forward + backward on each (q, k, v, dout) piece: [B, H, S_doc, D] each."""
    for q, k, v, do in pieces:
        out, lse = FWD(q, k, v, 0.0, True, scale=scale)
        BWD(do, q, k, v, out, lse, 0.0, True, scale=scale)


def _our_step(q, k, v, do, runs, scale):
    out, lse = varlen_forward(q, k, v, runs, runs, scale=scale, causal=True)
    varlen_backward(do, q, k, v, out, lse, runs, runs, scale=scale, causal=True)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench(lengths: list[int], heads: int, dim: int, reps: int) -> tuple[float, float]:
    s = sum(lengths)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, heads, s, dim, generator=g) for _ in range(4))  # [B, H, S, D]
    runs, cu = [], [0]
    for doc, n in enumerate(lengths):
        runs.append(Run(doc, cu[-1], n))
        cu.append(cu[-1] + n)
    pieces = [tuple(x[:, :, a:b].contiguous() for x in (q, k, v, do)) for a, b in zip(cu[:-1], cu[1:])]
    scale = dim**-0.5
    ours, raw = [], []
    _raw_step(pieces, scale), _our_step(q, k, v, do, runs, scale)  # warm-up
    for rep in range(reps):  # alternate the order so drift in a shared machine hits both
        if rep % 2:
            ours.append(_timed(lambda: _our_step(q, k, v, do, runs, scale)))
            raw.append(_timed(lambda: _raw_step(pieces, scale)))
        else:
            raw.append(_timed(lambda: _raw_step(pieces, scale)))
            ours.append(_timed(lambda: _our_step(q, k, v, do, runs, scale)))
    return statistics.median(raw), statistics.median(ours)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.seq < 8 or args.seq % 8:
        raise ValueError(f"--seq must be a positive multiple of 8, got {args.seq}")
    torch.set_num_threads(args.threads)
    s = args.seq
    cases = [("1 doc", [s]), ("4 docs", [s // 2, s // 4, s // 8, s // 8]), ("8 equal docs", [s // 8] * 8)]
    print(f"causal fwd+bwd, float32, B=1 H={args.heads} S={s} D={args.dim}, {args.threads} thread(s), "
          f"median of {args.reps} interleaved runs")
    print(f"{'case':<14}{'raw aten (s)':>14}{'ours (s)':>12}{'overhead %':>12}")
    for name, lengths in cases:
        raw, ours = bench(lengths, args.heads, args.dim, args.reps)
        print(f"{name:<14}{raw:>14.4f}{ours:>12.4f}{100 * (ours / raw - 1):>12.2f}")


if __name__ == "__main__":
    main()
