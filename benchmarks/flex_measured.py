"""Flexible SP groups MEASURED on CPU (gloo): flexible vs the best fixed SP degree on a skewed
mix, and the fitted per-size cost model checked against fresh measurements. Two tables.

Where it sits: outside the training data flow; it runs what a training step runs --
`init_group_bank`, a tiny Llama `patch`ed with the bank, `plan_flexible` / `plan_fixed`,
`flex/step.flex_microbatches` (shards laid out per slot group), forward + backward per slot.
Gradients are not synchronised (identical work for every plan; the step comparison is about
propagation, Hydraulis §4), and the optimizer is not run.

The mix: one long document (3.5 × the per-rank cap on 4 ranks, 1.75 × on 2: it needs the
group of all ranks) and many short ones (32..256 tokens). Per-rank cap `--cap` tokens.

Clocks. 2 ranks: wall clock (barrier, the step or micro-batch, barrier): the machine has 2
cores, so both ranks run in parallel. 4 ranks: more ranks than cores, so wall time measures
the scheduler; each rank's CPU time (`time.process_time`, every thread of the process,
gloo's included; a rank blocked in a collective uses none) is its busy time, and a step's
time is Σ over slots of the slowest rank's CPU time in that slot (every rank waits for the
slowest at each slot's collectives); with unequal counts (`plan_unequal`), where ranks wait
only for their group's members, the makespan of the plan's order with each micro-batch
lasting as long as its slowest member. Per-rank busy max/mean = max over ranks of Σ_slot
CPU time / its mean. The unequal-count plan runs without FSDP here like the others (its
unsharded-step gathers and syncs are once per step, outside the propagation compared).

Steps of the plans are interleaved (flex, fixed s1, fixed s2, ..., repeated `--reps` times)
so load from other processes on a shared machine hits every plan alike; medians are shown.

Cost model (FlexSP appendix: a profiled model within ~5 %): for every group size, single-
document micro-batches at 1/8 .. 1 of the group's capacity and two micro-batches of packed
short documents (1/4 and 1/2 of the capacity) are timed (min of `--fit-reps`) and
`GroupCost.fit` fits T_s(docs) = a_s·Σl² + b_s·Σl + d_s·n + c_s (d_s per document, c_s once
per micro-batch); FRESH micro-batches -- single documents at lengths not in the fit, and a
micro-batch of other short documents packed to 3/4 of the capacity -- are timed and
compared; the same fitted model plans the steps.

    PYTHONPATH=. python benchmarks/flex_measured.py                    # both worlds, ~1 min on 2 quiet cores
    PYTHONPATH=. python benchmarks/flex_measured.py --worlds 2 --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from benchmarks._ranks import run_ranks

FIT_FRACTIONS = (0.125, 0.25, 0.5, 0.75, 1.0)
CHECK_FRACTIONS = (0.1875, 0.375, 0.625, 0.875)
FIT_PACKED = (0.25, 0.5)  # packed short documents in the fit, at these fractions of the capacity


def _model(hidden: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384)
    return LlamaForCausalLM(cfg).train()


def _row(lengths: list[int], seed: int) -> dict:
    """A packed row (DataCollatorWithFlattening layout) of documents of these lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (sum(lengths),), generator=g)[None]  # [1, S]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]  # [1, S]
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}


class Timer:
    """Times a callable on every rank: wall (both barriers included) or this rank's CPU time."""

    def __init__(self, cpu: bool) -> None:
        self.cpu = cpu

    def __call__(self, fn) -> float:
        dist.barrier()
        t0 = time.process_time() if self.cpu else time.perf_counter()
        fn()
        if self.cpu:
            t = time.process_time() - t0
            dist.barrier()
            return t
        dist.barrier()
        return time.perf_counter() - t0


def _gather(x: list[float]) -> np.ndarray:
    """[world, len(x)] of every rank's values."""
    t = torch.tensor(x, dtype=torch.float64)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.stack(out).numpy()


def _fwd_bwd(model, shard) -> None:
    model(**shard).loss.backward()
    model.zero_grad(set_to_none=True)


def _microbatch_time(model, bank, size: int, lengths: list[int], reps: int, timer: Timer, seed: int) -> float:
    """Minimum over reps of the mean over ranks of one micro-batch (these documents) run by
    every group of `size` at once (the minimum: the run least disturbed by other load)."""
    from hf_longctx.data.sharding import shard_batch

    shard = shard_batch(_row(lengths, seed), bank.mesh(size), num_items_in_batch=sum(lengths))
    times = [timer(lambda: _fwd_bwd(model, shard)) for _ in range(reps)]
    return float(_gather(times).mean(axis=0).min())


def _cpu_step(plan, cpu_slots: np.ndarray) -> float:
    """A step's time from per-rank CPU times [world, slots]. Equal counts: Σ over slots of the
    slowest rank (every slot ends together: FSDP's and the groups' collectives). Unequal
    counts: each group's micro-batch starts when all its members are free and lasts as long
    as its slowest member; the step is when the last rank is done."""
    if plan.equal_calls:
        return float(cpu_slots.max(axis=0).sum())
    free = np.zeros(plan.world_size)
    for m, slot in enumerate(plan.slots):
        for g in slot:
            r = slice(g.ranks.start, g.ranks.stop)
            free[r] = free[r].max() + cpu_slots[r, m].max()
    return float(free.max())


def _short_docs(shape, tokens: float, rng) -> list[int]:
    """Short documents (32..256 tokens, padded for the shape) packed up to `tokens`."""
    docs, total = [], 0
    while True:
        n = shape.padded(int(rng.integers(32, 257)))
        if total + n > tokens:
            return docs
        docs.append(n)
        total += n


def _mix(world: int, cap: int, n_short: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    long = int(cap * (3.5 if world >= 4 else 1.75))
    return [long] + rng.integers(32, 257, size=n_short).tolist()


def _worker(rank: int, init_file: str, args: argparse.Namespace, results) -> None:
    from hf_longctx import GroupCost, init_group_bank, patch, plan_fixed, plan_flexible, plan_unequal
    from hf_longctx.flex.step import flex_microbatches

    torch.set_num_threads(1)
    world = args.world
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    cpu = world > 2
    timer = Timer(cpu)
    bank = init_group_bank(heads=4)
    model = patch(_model(args.hidden, args.layers), bank)
    for s in bank.sizes:  # warm-up: first-call allocations and graph set-up of every size
        _microbatch_time(model, bank, s, [64, 512], 3, timer, 0)

    # ---- cost model: fit, then fresh measurements ----
    fit_rows = []
    fit_rng = np.random.default_rng(args.seed + 2)
    for sh in bank.shapes:
        capacity = sh.capacity(args.cap)
        for f in FIT_FRACTIONS:
            n = int(capacity * f) // sh.doc_multiple * sh.doc_multiple
            fit_rows.append((sh.size, [n], _microbatch_time(model, bank, sh.size, [n], args.fit_reps, timer, n)))
        for f in FIT_PACKED:  # packed short documents: they separate the per-document from the per-micro-batch cost
            docs = _short_docs(sh, f * capacity, fit_rng)
            fit_rows.append((sh.size, docs, _microbatch_time(model, bank, sh.size, docs, args.fit_reps, timer, sum(docs))))
    cost = GroupCost.fit(*zip(*fit_rows))
    check = []
    rng = np.random.default_rng(args.seed + 1)
    for sh in bank.shapes:
        capacity = sh.capacity(args.cap)
        for f in CHECK_FRACTIONS:
            n = int(capacity * f) // sh.doc_multiple * sh.doc_multiple
            check.append((sh.size, "1 document", n, cost.microbatch(sh.size, [n]),
                          _microbatch_time(model, bank, sh.size, [n], args.fit_reps, timer, n + 7)))
        docs = _short_docs(sh, 0.75 * capacity, rng)  # fresh: other lengths, another count
        if docs:
            check.append((sh.size, f"{len(docs)} short documents", sum(docs), cost.microbatch(sh.size, docs),
                          _microbatch_time(model, bank, sh.size, docs, args.fit_reps, timer, sum(docs))))

    # ---- steps: flexible vs every feasible fixed degree, interleaved ----
    lengths = _mix(world, args.cap, args.short, args.seed)
    docs = [torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(i)).tolist() for i, n in enumerate(lengths)]
    plans = {
        "flexible": plan_flexible(lengths, shapes=bank.shapes, world_size=world, max_tokens_per_rank=args.cap, cost=cost),
        "flexible, unequal counts": plan_unequal(lengths, shapes=bank.shapes, world_size=world,
                                                 max_tokens_per_rank=args.cap, cost=cost),
    }
    for sh in bank.shapes:
        if sh.padded(max(lengths)) <= sh.capacity(args.cap):
            plans[f"fixed {sh.size} (U{sh.ulysses}×R{sh.ring}×dp{world // sh.size})"] = plan_fixed(
                lengths, shape=sh, shapes=bank.shapes, world_size=world, max_tokens_per_rank=args.cap, cost=cost)
    shards = {k: list(flex_microbatches(p, bank, docs)) for k, p in plans.items()}
    # The slots this rank runs, in order (all of them with equal counts).
    mine = {k: [m for m, slot in enumerate(p.slots) if any(rank in g.ranks for g in slot)] for k, p in plans.items()}
    res = {k: {"step": [], "busy": []} for k in plans}
    for _ in range(args.reps):
        for k, plan in plans.items():
            t_slot = [0.0] * plan.num_slots  # this rank's CPU time per slot (0 where it idles)

            def step():
                for m, shard in zip(mine[k], shards[k]):
                    c0 = time.process_time()
                    model(**shard).loss.backward()
                    t_slot[m] = time.process_time() - c0
                model.zero_grad(set_to_none=True)

            wall = timer(step)
            cpu_slots = _gather(t_slot)  # [world, slots]: each rank's CPU time per slot
            busy = cpu_slots.sum(axis=1)  # [world]
            res[k]["busy"].append(float(busy.max() / busy.mean()))
            res[k]["step"].append(float(np.median(_gather([wall]))) if not cpu else _cpu_step(plan, cpu_slots))
    if rank == 0:
        results.put({
            "world": world, "clock": "CPU time" if cpu else "wall clock", "check": check,
            "plans": {k: {"layouts": [list(x) for x in p.layouts()], **{f"model_{m}": v for m, v in _modelled(p, cost).items()},
                          **res[k]} for k, p in plans.items()},
        })
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, args: argparse.Namespace) -> dict:
    return run_ranks(_worker, world, argparse.Namespace(**vars(args), world=world))


def _modelled(plan, cost) -> dict:
    stats = plan.stats(cost)
    return {"step": stats["synced_step"], "busy": stats["busy_max_over_mean"]}


def _layouts(layouts: list[list[int]]) -> str:
    kinds = []
    for slot in layouts:
        k = "[" + ",".join(map(str, slot)) + "]"
        if k not in kinds:
            kinds.append(k)
    return f"{len(layouts)} slots: " + " ".join(kinds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--cap", type=int, default=1024, help="tokens per rank per micro-batch")
    ap.add_argument("--short", type=int, default=40, help="short documents in the step")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions of every plan's step")
    ap.add_argument("--fit-reps", type=int, default=5, help="timings per micro-batch of the cost model (minimum)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    results = [measure(w, args) for w in args.worlds]
    print(f"Tiny Llama (hidden {args.hidden}, {args.layers} layers, 4 heads / 2 KV), {args.cap} tokens per rank per "
          f"micro-batch, one long document + {args.short} short (32..256 tokens); medians of {args.reps} interleaved "
          "repetitions\n")
    print("| ranks (clock) | plan | slot layouts | step s (measured) | step (model, s) | busy max/mean measured | "
          "busy max/mean model | speed-up vs best fixed |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        plans = r["plans"]
        med = {k: statistics.median(v["step"]) for k, v in plans.items()}
        best_fixed = min(v for k, v in med.items() if k.startswith("fixed"))
        for k, v in plans.items():
            print(f"| {r['world']} ({r['clock']}) | {k} | {_layouts(v['layouts'])} | {med[k]:.3f} | {v['model_step']:.3f} | "
                  f"{statistics.median(v['busy']):.3f} | {v['model_busy']:.3f} | {best_fixed / med[k]:.2f}× |")
    print("\nCost model: T_s(docs) = a_s·Σl² + b_s·Σl + d_s·n + c_s fitted per group size (GroupCost.fit) on "
          f"single-document micro-batches at {', '.join(f'{f:g}' for f in FIT_FRACTIONS)} of the group's capacity and "
          f"packed short documents at {', '.join(f'{f:g}' for f in FIT_PACKED)} of it; checked on fresh micro-batches\n")
    print("| ranks (clock) | group size | micro-batch | tokens | predicted ms | measured ms | error |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        for size, what, tokens, pred, meas in r["check"]:
            print(f"| {r['world']} ({r['clock']}) | {size} | {what} | {tokens} | {1e3 * pred:.1f} | {1e3 * meas:.1f} | "
                  f"{100 * (pred - meas) / meas:+.1f} % |")
        errs = [abs(p - m) / m for *_, p, m in r["check"]]
        print(f"| {r['world']} | all | mean abs error | | | | {100 * np.mean(errs):.1f} % |")


if __name__ == "__main__":
    main()
