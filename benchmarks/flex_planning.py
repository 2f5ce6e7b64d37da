"""Benchmark of flexible SP groups (flex/packing.py) against the best fixed SP degree:
one table.

Where it sits: outside the training data flow; it draws steps with `StepSampler` exactly as
a training loop would, from the length files of benchmarks/data, keeping the long tail
(documents clipped at 128K, four times the 32K per-rank cap, so a fixed degree must be
>= 4 and a flexible plan must give those documents a group of >= 4 ranks).

Cost: a Llama-2-7B-shaped model (hidden 4096, 32 layers, 32 heads = 32 KV heads,
intermediate 11008, vocab 32000) on H100-class GPUs, in seconds, with these FIXED constants:
- compute: `CostModel.from_config` FLOPs (6·N per token + 6·layers·hidden per l²) at 50 % of
  989 TFLOP/s, split evenly over the s ranks of a group;
- Ulysses: per rank and per global token 2·(U−1)/U·(1/s)·(2d + 2d_kv)·e·layers bytes (the
  README formula, e = 2 bytes bf16) at 300 GB/s, U within a node of 8 ranks;
- ring: per rank and per global token (R−1)·(1/s)·2·d_kv·(2e + 4)·layers bytes (K/V hops in
  forward and backward at e bytes plus fp32 dK/dV hops) at 40 GB/s across nodes, not
  overlapped with compute (conservative for the groups that need a ring);
- the Ulysses × ring split of every size: `sp_groups.ulysses_split` (32 heads, 8 per node).
Steps hold 0.9 × ranks × slots × 32K tokens. "ideal" = Σ_doc min_s s·T_s(doc) / ranks (no
plan can beat it); "fixed" = the best over feasible sizes s of the default fixed-degree
planner (`plan_microbatches`, dp = ranks/s, cap s·32K); "fixed bound" = the best over s of
the provable floor of any fixed-degree plan (the slot holding the costliest document
cannot have its other groups costlier than the longest remaining documents packed
densely), on the same ideal. "planner ms": CPU time of `plan_flexible` per step (process
time, so that other load on a shared machine does not count). "unequal counts": the same
step planned with `plan_unequal` (ranks run different numbers of micro-batches, the model
unsharded for the step): its modelled makespan / the same ideal (no equal-count floor).

    PYTHONPATH=. python benchmarks/flex_planning.py              # full table
    python benchmarks/flex_planning.py --steps 4    # quicker
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.packing import distributions
from hf_longctx.data.cost import GroupCost
from hf_longctx.sp_groups import group_shapes
from hf_longctx.flex.packing import plan_fixed, plan_flexible
from hf_longctx.flex.unequal import plan_unequal
from hf_longctx.data.sampler import StepSampler

CAP = 32768  # tokens per rank per micro-batch
LONG = 131072  # documents are clipped here (the long tail is kept up to 128K)
HIDDEN, LAYERS, HEADS, KV_HEADS, INTER, VOCAB = 4096, 32, 32, 32, 11008, 32000
NODE = 8


def llama7b_cost(world: int) -> tuple[GroupCost, tuple]:
    """The cost of the module docstring: `GroupCost.from_config` with its default constants
    (50 % of 989 TFLOP/s, Ulysses at 300 GB/s within a node of 8, ring at 40 GB/s, bf16)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, vocab_size=VOCAB)
    shapes = group_shapes(world, heads=HEADS, ranks_per_node=NODE)
    return GroupCost.from_config(cfg, shapes), shapes


def fixed_bound(lengths: np.ndarray, shape, cost: GroupCost, world: int) -> float:
    """Floor (seconds) of any plan with every group of `shape` (benchmarks/packing.lower_bound)."""
    s, dp = shape.size, world // shape.size
    cap = shape.capacity(CAP)
    p = np.sort(-(-lengths // shape.doc_multiple) * shape.doc_multiple)[::-1]
    m = cost[s]
    c = m(p)
    total = float(c.sum())
    rest = p[1:]
    take = np.minimum(np.cumsum(rest), (dp - 1) * cap)
    portion = np.diff(np.concatenate([[0], take]))
    dense = m.a * float((portion * rest).sum()) + m.b * float(take[-1] if len(take) else 0)
    return max(total / dp, c.max() + (total - c.max() - dense) / dp)


def run(lengths, world, slots, steps, seed):
    cost, shapes = llama7b_cost(world)
    sampler = StepSampler(np.minimum(lengths, LONG), tokens_per_step=int(0.9 * world * slots * CAP), seed=seed)
    batch = [sampler.lengths[s] for s in sampler.epoch_steps(0)[:steps]]
    rec = {k: [] for k in ("flex", "fixed", "bound", "speedup", "ms", "slots", "best_s", "busy", "layouts",
                           "unequal", "speedup_u", "ms_u", "calls_lo", "calls_hi")}
    for step in batch:
        t0 = time.process_time()  # CPU time: the benchmark machine is shared
        flex = plan_flexible(step, shapes=shapes, world_size=world, max_tokens_per_rank=CAP, cost=cost, num_slots=slots)
        rec["ms"].append(1e3 * (time.process_time() - t0))
        fs = flex.stats(cost)
        ideal = fs["ideal_step"]
        fixed, bound, best_s = np.inf, np.inf, None
        for sh in shapes:
            if (-(-step.max() // sh.doc_multiple) * sh.doc_multiple) > sh.capacity(CAP):
                continue  # this degree cannot hold the longest document
            fp = plan_fixed(step, shape=sh, shapes=shapes, world_size=world, max_tokens_per_rank=CAP, cost=cost)
            t = fp.stats(cost)["synced_step"]
            if t < fixed:
                fixed, best_s = t, sh
            bound = min(bound, fixed_bound(step, sh, cost, world))
        rec["flex"].append(fs["synced_step"] / ideal)
        rec["fixed"].append(fixed / ideal)
        rec["bound"].append(bound / ideal)
        rec["speedup"].append(fixed / fs["synced_step"])
        rec["slots"].append(flex.num_slots)
        rec["best_s"].append(f"{best_s.ulysses}×{best_s.ring}×{world // best_s.size}")
        rec["busy"].append(fs["busy_max_over_mean"])
        rec["layouts"].append(len({tuple(sorted(l)) for l in flex.layouts()}))
        t0 = time.process_time()
        unequal = plan_unequal(step, shapes=shapes, world_size=world, max_tokens_per_rank=CAP, cost=cost)
        rec["ms_u"].append(1e3 * (time.process_time() - t0))
        us = unequal.stats(cost)
        rec["unequal"].append(us["synced_step"] / ideal)
        rec["speedup_u"].append(fixed / us["synced_step"])
        rec["calls_lo"].append(us["calls"][0])
        rec["calls_hi"].append(us["calls"][1])
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="steps per distribution and setting (8 ranks)")
    ap.add_argument("--scale-steps", type=int, default=2, help="steps for the 64-rank rows (0: skip)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    dists = distributions()
    settings = [(8, 8, args.steps), (8, 4, args.steps)]
    if args.scale_steps:
        settings += [(64, 8, args.scale_steps), (64, 4, args.scale_steps)]
    print("| distribution | ranks × slots | flexible / ideal | best fixed (U×R×dp) / ideal | fixed-degree bound / ideal | "
          "speed-up over best fixed | slots used | distinct layouts | busy max/mean | planner ms | "
          "unequal counts: makespan / ideal | speed-up over best fixed | micro-batches per rank | planner ms |")
    print("|" + "---|" * 14)
    for name, lengths in dists.items():
        for world, slots, steps in settings:
            r = run(lengths, world, slots, steps, args.seed)
            a = {k: np.array(v) for k, v in r.items() if k not in ("best_s",)}
            common = max(set(r["best_s"]), key=r["best_s"].count)
            print(
                f"| {name} | {world} × {slots} | {a['flex'].mean():.3f} ({a['flex'].max():.3f}) | "
                f"{a['fixed'].mean():.3f} ({a['fixed'].max():.3f}; {common}) | {a['bound'].mean():.3f} | "
                f"{a['speedup'].mean():.2f}× ({a['speedup'].min():.2f}) | {a['slots'].mean():.2f} | "
                f"{a['layouts'].mean():.1f} | {a['busy'].mean():.3f} | {a['ms'].mean():.0f} ({a['ms'].max():.0f}) | "
                f"{a['unequal'].mean():.3f} ({a['unequal'].max():.3f}) | {a['speedup_u'].mean():.2f}× ({a['speedup_u'].min():.2f}) | "
                f"{a['calls_lo'].min()}–{a['calls_hi'].max()} | {a['ms_u'].mean():.0f} ({a['ms_u'].max():.0f}) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
