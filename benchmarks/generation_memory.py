"""The memory of a sequence-parallel rollout, measured: every tensor alive at the device peak of
`sp_generate` by name, beside the planner's generation term.

Where it sits: outside the library, beside `benchmarks/memory_budget.py` (the training step's
census). It runs `sp_generate` (greedy, one process or `--world` gloo ranks on a Ulysses mesh) on a
scaled-down Llama in bf16 -- one long prompt and a few short ones, packed, plus the completions --
under `benchmarks/census.Census`: the device peak above the weights (parameters exist before the
census, so they are not counted, as `max_memory_allocated()` minus the weights on a GPU), the
named tensors at that peak, the attention kernel's workspace apart. The planner's figure is
`capacity/generation_budget.sp_generation_budget` for the same rollout, less its weights term
(local weights here): tests/unit/test_generation_budget.py holds it within 5 %.

Run: PYTHONPATH=. python benchmarks/generation_memory.py                 (one process, ~1 min)
     PYTHONPATH=. python benchmarks/generation_memory.py --world 4 --tokens 8192 --modes off max
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.memory_budget import SHAPES, config, kernels_in

MODES = {"off": dict(memory="off"), "balanced": dict(memory="balanced"), "max": dict(memory="max")}
ROWS, NEW = 4, 8  # rows of the rollout (one long prompt, the rest short) and new tokens per row


def rollout(tokens: int) -> list[list[int]]:
    """One prompt of `tokens` - (ROWS - 1) * 8 tokens and ROWS - 1 prompts of 8 (seeded)."""
    g = torch.Generator().manual_seed(1)
    lengths = [tokens - 8 * (ROWS - 1)] + [8] * (ROWS - 1)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]


def measure(mesh, shape: str, mode: str, tokens: int) -> dict:
    """One counted `sp_generate` on this rank: device peak, the named tensors at the peak, S_local."""
    from transformers import LlamaForCausalLM

    from benchmarks.census import Census
    from hf_longctx import patch
    from hf_longctx.generation.loop import sp_generate

    torch.manual_seed(0)
    model = patch(LlamaForCausalLM(config(shape)).to(torch.bfloat16), mesh, **MODES[mode])
    prompts = rollout(tokens)
    sp_generate(model, prompts[:1], mesh, max_new_tokens=2, log=None, eos_token_id=[], pad_token_id=0)  # lazy initialisations
    census = Census()
    census.name_modules(model)
    with kernels_in(census), census:
        sp_generate(model, prompts, mesh, max_new_tokens=NEW, eos_token_id=[], pad_token_id=0, log=None)
    census.close()
    return dict(device=census.peak.device, by_name=census.peak.by_name, kernel=census.kernel_peak,
                s_local=tokens / mesh.sp, rows=len(prompts))


def estimate(shape: str, mode: str, tokens: int, ulysses: int, ring: int = 1) -> float:
    """The planner's device bytes of the rollout above the weights (local weights: none gathered)."""
    from hf_longctx.capacity.generation_budget import sp_generation_budget
    from hf_longctx.capacity.search import preset_setting
    from hf_longctx.data.model_dims import ModelDims

    dims = ModelDims.from_config(config(shape))
    setting = preset_setting(ulysses, ring, 1, MODES[mode]["memory"], dims)
    budget = sp_generation_budget(dims, setting, tokens=tokens + ROWS * NEW, dtype="bf16", rows=ROWS, prompt_tokens=tokens)
    return budget.device


def _worker(rank: int, init_file: str, args, results) -> None:
    import torch.distributed as dist

    from hf_longctx.distributed.mesh import init_sequence_parallel

    torch.set_num_threads(1)
    if args.world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.world)
    mesh = init_sequence_parallel(args.world // args.ring, args.ring)
    rows = []
    for shape, mode, tokens in ((a, b, c) for a in args.shapes for b in args.modes for c in args.tokens):
        r = measure(mesh, shape, mode, tokens)
        if args.world > 1:
            every = [None] * args.world
            dist.all_gather_object(every, r)  # [world]: every rank's census dict
            r = max(every, key=lambda x: x["device"])  # the worst rank decides
        rows.append((shape, mode, tokens, r))
    if rank == 0:
        results.put(rows)
    if args.world > 1:
        dist.destroy_process_group()


def main() -> None:
    from benchmarks._ranks import rows_of

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=1, help="gloo ranks of one SP group")
    parser.add_argument("--ring", type=int, default=1, help="ring degree (Ulysses = world / ring)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--shapes", nargs="+", default=["T1", "A"], choices=list(SHAPES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    rows = rows_of(_worker, args.world, args)
    print(f"Rollout memory, bf16, {args.world} rank(s) (Ulysses {args.world // args.ring} x ring {args.ring}), {ROWS} rows, {NEW} new tokens each; "
          "device = peak above the weights (Census) per local prompt token\n")
    print("| shape | mode | prompt tokens | device B/token | planner B/token | error |")
    print("|---|---|---:|---:|---:|---:|")
    for shape, mode, tokens, r in rows:
        est = estimate(shape, mode, tokens, args.world // args.ring, args.ring)
        print(f"| {shape} | {mode} | {tokens} | {r['device'] / r['s_local']:.0f} | {est / r['s_local']:.0f} | "
              f"{est / r['device'] - 1:+.1%} |")
    for shape, mode, tokens, r in rows:
        print(f"\n{shape} {mode} {tokens}: tensors alive at the device peak (bytes per local prompt token)")
        for (name, host), b in sorted(r["by_name"].items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {b / r['s_local']:9.1f}  {name}")


if __name__ == "__main__":
    main()
