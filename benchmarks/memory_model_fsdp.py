"""Validate the memory model's FSDP terms on several ranks: per-rank peaks of a flexible step
with equal micro-batch counts (FSDP2 resharding per unit) and with unequal counts (the model
unsharded for the step), measured with MemTracker, next to `estimate_memory(...)`.

Where it sits: outside the library, beside `benchmarks/memory_model.py` (one process, no
FSDP). Here `--world` gloo ranks shard a tiny Llama with `fsdp_plan(mixed_precision="fp32")`
over the group bank's world; every group has `--group-size` ranks (default 1: the SP terms
are those of `memory_model.py` and the rows differ only in what FSDP holds; 2 or 4 add the
all-to-all buffers, or the ring's with `--ranks-per-node 1`), each micro-batch holds
`tokens` tokens of four packed documents (per group, before sharding), and one step is
`run_flex_step` + AdamW. Equal counts: every group runs `--microbatches` micro-batches, with
FSDP's gradient reduce-scatter in the last backward only (the default: the fp32 unsharded
gradients are held through the step) or in every backward (`sync_each_microbatch=True`).
Unequal counts: group i runs `--microbatches` + i micro-batches (a valid `plan_unequal`-style
plan: every group's last micro-batch is its own), with `flex/unsharded_step.py`
holding the gathered parameters and the fp32 unsharded gradients through the step. The
memory model's unsharded-step terms (capacity/estimate.py docstring) are what the second row
checks. Peaks are MemTracker's (tensor storage on this CPU), after a warm-up step, worst
rank.

    PYTHONPATH=. python benchmarks/memory_model_fsdp.py                     # about 1 minute
    PYTHONPATH=. python benchmarks/memory_model_fsdp.py --world 4 --tokens 1024 4096
    PYTHONPATH=. python benchmarks/memory_model_fsdp.py --world 4 --group-size 2                       # Ulysses 2
    PYTHONPATH=. python benchmarks/memory_model_fsdp.py --world 4 --group-size 2 --ranks-per-node 1    # ring 2
"""

from __future__ import annotations

import argparse
from contextlib import ExitStack
from datetime import timedelta

import torch
import torch.distributed as dist

from benchmarks._ranks import run_ranks
from benchmarks.memory_model import tiny_config as _base_config


def tiny_config(args):
    """memory_model.py's tiny Llama, with --layers / --vocab overrides (layer- vs vocabulary-dominated)."""
    c = _base_config()
    c.num_hidden_layers, c.vocab_size = args.layers or c.num_hidden_layers, args.vocab or c.vocab_size
    return c


MODES = ("step", "microbatch", "unequal")  # grad sync in the last backward / in every backward / unequal counts


def _plan(bank, tokens: int, microbatches: int, equal: bool):
    """Every slot: the bank's groups of its largest size, each with four documents of
    tokens/4; group i runs `microbatches` (+ i with unequal counts, so every group's last
    micro-batch is its own)."""
    from hf_longctx.flex.plan import FlexGroup, FlexPlan

    size = bank.max_size
    groups = bank.world_size // size
    counts = [microbatches if equal else microbatches + i for i in range(groups)]
    slots, docs = [], 0
    for m in range(max(counts)):
        slot = []
        for i in range(groups):
            if m < counts[i]:
                slot.append(FlexGroup(size=size, index=i, docs=tuple(range(docs, docs + 4))))
                docs += 4
        slots.append(tuple(slot))
    shapes = tuple(sh for sh in bank.shapes if sh.size == size)
    return FlexPlan(slots=tuple(slots), lengths=(tokens // 4,) * docs, world_size=bank.world_size,
                    max_tokens_per_rank=tokens // size, shapes=shapes, equal_calls=equal)


def _measure(bank, tokens: int, microbatches: int, mode: str, config) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import LlamaForCausalLM

    from hf_longctx.flex.step import flex_microbatches, run_flex_step
    from hf_longctx.flex.unsharded_step import unsharded_step
    from hf_longctx.integrations.accelerate import fsdp_plan
    from hf_longctx.integrations.model_patch import patch

    torch.manual_seed(0)
    model = patch(LlamaForCausalLM(config), bank)
    fsdp_plan(model, bank.world, mixed_precision="fp32").apply(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    equal = mode != "unequal"
    plan = _plan(bank, tokens, microbatches, equal)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in plan.lengths]

    run_flex_step(model, bank, plan, docs)  # warm-up: AdamW's moments exist as in steady state
    opt.step()
    opt.zero_grad(set_to_none=True)
    # The tracked step is run_flex_step's loop written out: MemTracker refuses a second
    # forward of the same modules unless its module stats are reset in between (its
    # global peak is kept).
    shards = list(flex_microbatches(plan, bank, docs))
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker, ExitStack() as stack:
        if not equal:
            before_backward = stack.enter_context(unsharded_step(model, len(shards)))
        for i, shard in enumerate(shards):
            tracker.reset_mod_stats()
            if equal:
                model.set_requires_gradient_sync(mode == "microbatch" or i == len(shards) - 1)
            loss = model(**shard).loss
            if not equal:
                before_backward(i)
            loss.backward()
        stack.close()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return int(max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values()))


def _worker(rank: int, init_file: str, args, results) -> None:
    from hf_longctx.flex.bank import init_group_bank

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.world,
                            timeout=timedelta(minutes=10))
    bank = init_group_bank(heads=tiny_config(args).num_attention_heads, min_size=args.group_size,
                           max_size=args.group_size, ranks_per_node=args.ranks_per_node or args.world)
    rows = []
    for tokens in args.tokens:
        for mode in MODES:
            peak = _measure(bank, tokens, args.microbatches, mode, tiny_config(args))
            peaks = [None] * args.world
            dist.all_gather_object(peaks, peak)
            rows.append((tokens, mode, max(peaks)))
    if rank == 0:
        results.put(((bank.shapes[0].ulysses, bank.shapes[0].ring), rows))
    dist.destroy_process_group()


def main() -> None:
    from hf_longctx.capacity.estimate import ModelDims, Setting, estimate_memory

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096], help="tokens per micro-batch")
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default memory_model.py's 4)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default memory_model.py's 8192)")
    ap.add_argument("--group-size", type=int, default=1, help="SP group size of every micro-batch (a power of two)")
    ap.add_argument("--ranks-per-node", type=int, default=None,
                    help="Ulysses stays within a node: 1 makes every group a ring (default: the world)")
    args = ap.parse_args()
    (u, r), rows = run_ranks(_worker, args.world, args)
    c = tiny_config(args)
    dims = ModelDims.from_config(c)
    mib = 2**20
    print(f"\nTiny Llama (hidden {c.hidden_size}, {c.num_hidden_layers} layers, vocab {c.vocab_size}, "
          f"{dims.params / 1e6:.2f}M params), {args.world} gloo ranks, FSDP2 fp32 over all of them, SP groups of "
          f"{args.group_size} (ulysses {u} x ring {r}), "
          f"AdamW; peak per rank of one step (MemTracker, worst rank) vs estimate_memory\n")
    print("| micro-batch counts | tokens per micro-batch | measured MiB | estimated MiB | error |")
    print("|---|---:|---:|---:|---:|")
    worst = 0.0
    labels = {"step": f"equal ({args.microbatches} each), sync in the last backward",
              "microbatch": f"equal ({args.microbatches} each), sync in every backward",
              "unequal": f"unequal ({args.microbatches}..{args.microbatches + args.world // args.group_size - 1}), unsharded step"}
    for tokens, mode, peak in rows:
        est = estimate_memory(dims, Setting(ulysses=u, ring=r), world=args.world, tokens=tokens, dtype="fp32",
                              optimizer="adamw", unsharded_step=mode == "unequal", microbatches=args.microbatches,
                              grad_sync="microbatch" if mode == "microbatch" else "step").peak
        err = est / peak - 1
        worst = max(worst, abs(err))
        print(f"| {labels[mode]} | {tokens} | {peak / mib:.1f} | {est / mib:.1f} | {err:+.1%} |", flush=True)
    print(f"\nworst |error| = {worst:.1%} (target 10%)")


if __name__ == "__main__":
    main()
