"""Benchmark of the micro-batch planner strategies (data/packing.py) on real length
distributions: one table.

Where it sits: outside the training data flow; it runs `StepSampler` (data/sampler.py)
and `plan_microbatches` exactly as a training loop would, on the length files in
benchmarks/data (see its README). It measures the objective of the Hydraulis two-stage
assignment / FlexSP appendix setting: with FSDP every rank waits for the slowest at
every micro-batch, so a step lasts Σ over slots of the slowest rank's cost.

Setup: steps of 0.9 × ranks × micro-batches × 32K tokens, documents
clipped to 32K, T(l) = l² + 16384·l; at 8 and at 4 micro-batches per step, and one
scale row set at 64 ranks × 16M tokens. Columns are means over steps (max in
parentheses). "lower bound" is a provable floor for each step: on synced/ideal, the
slot holding the costliest document cannot have its other ranks costlier than the
longest remaining documents packed densely; on rank max/mean, of the k costliest
documents some rank holds ⌈k/ranks⌉ (best over k).

    python benchmarks/packing.py               # full table (~1-2 min on one core)
    python benchmarks/packing.py --steps 4     # quicker
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import numpy as np

from hf_longctx.data.cost import CostModel
from hf_longctx.data.packing import STRATEGIES, microbatch_bound, plan_microbatches
from hf_longctx.data.sampler import StepSampler

DATA = Path(__file__).resolve().parent / "data"
CAP = 32768
COST = CostModel(a=1.0, b=16384.0, c=0.0)


def load(name: str) -> np.ndarray:
    with gzip.open(DATA / name, "rt") as f:
        if name.endswith(".json.gz"):
            return np.asarray(json.load(f), dtype=np.int64)
        return np.asarray([int(line) for line in f if line.strip()], dtype=np.int64)


def distributions() -> dict[str, np.ndarray]:
    """The three length distributions of the planning benchmarks (benchmarks/data)."""
    return {
        "wikipedia": load("wikipedia_lengths.txt.gz"),
        "wlbllm": load("dist_wlbllm.json.gz"),
        "prolong": load("dist_prolong.json.gz"),
    }


def lower_bound(lengths: np.ndarray, dp: int) -> float:
    c = COST(lengths)
    total = float(c.sum())
    rest = np.sort(lengths)[::-1][1:]
    take = np.minimum(np.cumsum(rest), (dp - 1) * CAP)
    portion = np.diff(np.concatenate([[0], take]))
    dense = COST.a * float((portion * rest).sum()) + COST.b * float(take[-1] if len(take) else 0)
    return max(1.0, (c.max() + (total - c.max() - dense) / dp) / (total / dp))


def rank_lower_bound(lengths: np.ndarray, dp: int) -> float:
    """A floor on per-rank max/mean (no plan can beat it): of the k costliest documents
    some rank holds at least ⌈k/dp⌉, so it pays at least the ⌈k/dp⌉ cheapest of them;
    best over k, against the mean total / dp."""
    c = np.sort(COST(lengths).astype(np.float64))[::-1]
    if not len(c):
        return 1.0
    pre = np.concatenate([[0.0], np.cumsum(c)])
    k = np.arange(1, len(c) + 1)
    q = -(-k // dp)
    return max(1.0, float((pre[k] - pre[k - q]).max()) / (float(c.sum()) / dp))


def run(lengths: np.ndarray, dp: int, microbatches: int, steps: int, seed: int, strategies) -> list[dict]:
    budget = int(0.9 * dp * microbatches * CAP)
    sampler = StepSampler(np.minimum(lengths, CAP), tokens_per_step=budget, seed=seed)
    batch = [sampler.lengths[s] for s in sampler.epoch_steps(0)[:steps]]
    rows = []
    for strategy in strategies:
        rec = {k: [] for k in ("rank", "synced", "mbs", "bound", "ms")}
        for step in batch:
            t0 = time.perf_counter()
            plan = plan_microbatches(step, dp_size=dp, max_tokens=CAP, cost=COST, strategy=strategy, seed=seed)
            rec["ms"].append(1e3 * (time.perf_counter() - t0))
            s = plan.stats(COST)
            rec["rank"].append(s["rank_max_over_mean"])
            rec["synced"].append(s["synced_over_ideal"])
            rec["mbs"].append(plan.num_microbatches)
            rec["bound"].append(microbatch_bound(plan))
        rows.append(dict(strategy=strategy, **{k: np.array(v) for k, v in rec.items()}))
    rows.append(dict(strategy="lower bound", synced=np.array([lower_bound(s, dp) for s in batch]),
                     rank=np.array([rank_lower_bound(s, dp) for s in batch])))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16, help="steps per distribution and setting")
    ap.add_argument("--scale-steps", type=int, default=2, help="steps for the 64-rank × 16M-token rows (0: skip)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset of strategies")
    args = ap.parse_args()
    dists = distributions()
    settings = [(8, 8, args.steps), (8, 4, args.steps)]
    if args.scale_steps:
        settings.append((64, 16 * 2**20 / (0.9 * 64 * CAP), args.scale_steps))  # 16M tokens per step
    header = (
        "| distribution | ranks × mb/step | strategy | rank max/mean | synced/ideal | "
        "micro-batches (bound) | planner ms |"
    )
    print(header)
    print("|" + "---|" * 7)
    for name, lengths in dists.items():
        for dp, mbs, steps in settings:
            for row in run(lengths, dp, mbs, steps, args.seed, args.strategies.split(",")):
                label = f"{dp} × {mbs:g}" if dp == 8 else f"{dp} × 16M tok"
                synced = f"{row['synced'].mean():.3f} ({row['synced'].max():.3f})"
                if row["strategy"] == "lower bound":
                    rank = f"{row['rank'].mean():.3f} ({row['rank'].max():.3f})"
                    print(f"| {name} | {label} | *lower bound* | {rank} | {synced} | | |")
                    continue
                print(
                    f"| {name} | {label} | {row['strategy']} | {row['rank'].mean():.3f} ({row['rank'].max():.3f}) | "
                    f"{synced} | {row['mbs'].mean():.2f} ({row['mbs'].max()}; ≤{row['bound'].max()}) | "
                    f"{row['ms'].mean():.1f} ({row['ms'].max():.1f}) |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
