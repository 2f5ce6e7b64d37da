"""The per-token memory budget of a training step, measured: every tensor alive at the device
peak by name, in bytes per local token, device and host, per memory mode.

Where it sits: outside the library. It drives the public path (`init_sequence_parallel`,
`patch`, `shard_batch`) of a scaled-down Llama (bf16) on `--world` gloo ranks and runs one
forward + backward under `benchmarks/census.Census`, with the CUDA offload branches running on
CPU through `census.EmulatedStreams` (pinned host buffers from a real pool, copies back to the
"device" as new tensors), so the host side of every offload is counted as host. Parameters and
their gradients (allocated before the counted step) are not counted: the figures are memory
ABOVE the weights, as `torch.cuda.max_memory_allocated()` minus the weights on a GPU.

Per mode (the `patch(memory=...)` presets and the checkpoint modes, with and without FPDT
chunks / K/V offload) it prints the device peak per local token (bytes and hidden-size bf16
vectors), the host bytes per token and layer, and the named tensors alive at the peak. The
planner (`capacity/estimate.py`, `layer_budget`) is derived from these lists; the last columns
put its estimate beside each measurement (tests/unit/test_memory_budget.py holds it within 5 %).

Run: PYTHONPATH=. python benchmarks/memory_budget.py                  (4 ranks, 3 lengths, ~10 min)
     PYTHONPATH=. python benchmarks/memory_budget.py --world 1 --tokens 4096 --modes max   (quick)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from datetime import timedelta

import torch

SHAPES = {  # scaled-down Llamas: hidden, intermediate, layers, heads, kv heads, vocab
    "A": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=4096),
    "B": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=12,
              num_key_value_heads=4, vocab_size=4096),
    # small ones for tests/unit/test_memory_budget.py (CPU time: the attention is quadratic)
    "T1": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=2048),
    "T2": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=3, num_attention_heads=6,
               num_key_value_heads=2, vocab_size=2048),
}
PHASES = [  # (phase, the library function on the stack), innermost first
    ("layer backward: pre-attention backward", "layer_run.py:_pre_backward"),
    ("layer backward: FPDT backward loop", "fpdt.py:fpdt_backward_chunks"),
    ("layer backward: post-attention backward", "layer_run.py:_post_backward"),
    ("layer backward: attention backward", "layer_run.py:_usp_backward"),
    ("layer backward: recompute", "layer_run.py:run_backward"),
    ("forward", "layer_run.py:run_forward"),
    ("final norm backward", "tiling.py:backward"),
    ("loss", "chunked_loss.py:forward"),
    ("log-prob head backward", "chunked_logprobs.py:backward"),
    ("loss", "chunked_logprobs.py:forward"),
    ("loss", "tiling.py:forward"),  # a chunked norm's forward (ops/tiling._Tokenwise.forward)
]
MODES = {  # label -> (patch options, FPDT chunks)
    "off": (dict(memory="off"), 1),
    "balanced": (dict(memory="balanced"), 1),
    "high": (dict(memory="high"), 1),
    "max": (dict(memory="max"), 1),
    "off u=4": (dict(memory="off"), 4),
    "high u=4 offload": (dict(memory="high"), 4),
    "max u=4 offload": (dict(memory="max"), 4),
    "checkpoint=True u=4 offload": (dict(checkpoint=True, kv_offload=True), 4),  # whole layers (no chunks)
}


def config(shape: str):
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPES[shape], max_position_embeddings=1 << 20)


@contextlib.contextmanager
def kernels_in(census):
    """Every local attention kernel call inside `census.kernel()` (its workspace counted apart)."""
    from hf_longctx.ops import kernels

    saved = kernels.varlen_forward, kernels.varlen_backward

    def wrap(fn):
        def call(*args, **kwargs):
            with census.kernel():
                return fn(*args, **kwargs)
        return call

    kernels.varlen_forward, kernels.varlen_backward = (wrap(f) for f in saved)
    try:
        yield
    finally:
        kernels.varlen_forward, kernels.varlen_backward = saved


def measure(mesh, shape: str, mode: str, tokens: int, task: str = "sft") -> dict:
    """One counted forward + backward on this rank: device peak, host peak, the named tensors
    at the device peak (bytes), S_local."""
    return measure_lengths(mesh, shape, mode, [tokens], task=task)[0]


def measure_lengths(mesh, shape: str, mode: str, lengths: list[int], warm_up: bool = True,
                    task: str = "sft") -> list[dict]:
    """`measure` at several lengths with one patched model (one warm-up step, at the first length;
    without it -- the tests, to save CPU time -- the gradients are allocated ahead instead, and the
    first step's one-off allocations, a few KiB, are counted). `task`: "sft" (the model's loss),
    "dpo" or "grpo" (`benchmarks/post_training_steps.py`: a frozen reference of the same shape,
    patched as the trainers patch it, runs its forward first; its weights are not counted)."""
    from transformers import LlamaForCausalLM

    from benchmarks.census import Census, EmulatedStreams, emulated_offload, frames_phase
    from benchmarks.post_training_steps import batch as task_batch
    from benchmarks.post_training_steps import step
    from hf_longctx import patch
    from hf_longctx.ops.host_pool import HostPool
    from hf_longctx.training.base.reference import reference_on_mesh

    options, chunks = MODES[mode]
    mesh = dataclasses.replace(mesh, fpdt_chunks=chunks)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config(shape)).to(torch.bfloat16)
    ref = LlamaForCausalLM(config(shape)).to(torch.bfloat16) if task != "sft" else None
    streams = EmulatedStreams()
    g = torch.Generator().manual_seed(1)

    def shard(tokens: int) -> dict:
        ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=g)
        # One document: every query chunk sees every earlier K/V chunk, the worst case the planner budgets
        # (packed documents that end at chunk boundaries skip FPDT's dq accumulators)
        return task_batch(task, ids, mesh)

    with emulated_offload(streams):
        patch(model, mesh, **options)
        model.train()
        if ref is not None:
            ref = reference_on_mesh(ref, model, mesh)
        if warm_up:
            step(task, model, ref, shard(lengths[0]), mesh)  # lazy initialisations, gradients allocated
        else:
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
    out = []
    for tokens in lengths:
        batch = shard(tokens)
        census = Census()
        census.name_modules(model)
        if ref is not None:
            census.name_modules(ref, "reference.")
        census.phase_of = frames_phase(PHASES)
        streams.census, streams.pool = census, HostPool(alloc=streams._alloc)  # bound at patch(): count their host side
        with emulated_offload(streams), kernels_in(census), census:
            step(task, model, ref, batch, mesh)
        census.close()
        out.append(dict(task=task, device=census.peak.device, host=census.host_peak, s_local=batch["input_ids"].shape[1],
                        by_name=census.peak.by_name, layers=model.config.num_hidden_layers, kernel=census.kernel_peak,
                        phases={k: (v.device, v.by_name) for k, v in census.phases.items()}))
    return out


def _worker(rank: int, init_file: str, args, results) -> None:
    import torch.distributed as dist

    from hf_longctx.distributed.mesh import init_sequence_parallel

    torch.set_num_threads(1)
    if args.world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.world,
                                timeout=timedelta(minutes=30))
    mesh = init_sequence_parallel(args.world // args.ring, args.ring)
    rows = []
    for shape, mode, task in ((a, b, c) for a in args.shapes for b in args.modes for c in getattr(args, "tasks", ["sft"])):
        for tokens, r in zip(args.tokens, measure_lengths(mesh, shape, mode, args.tokens, task=task)):
            if args.world > 1:
                both = [None] * args.world
                dist.all_gather_object(both, r)
                r = max(both, key=lambda x: x["device"])  # the worst rank decides
            rows.append((shape, mode, tokens, r))
            if rank == 0:
                print(f"  {task} {shape} {mode} {tokens}: device {r['device'] / r['s_local']:.0f} B/token, "
                      f"host {r['host'] / r['s_local'] / r['layers']:.0f} B/token/layer", flush=True)
    if rank == 0:
        results.put(rows)
    if args.world > 1:
        dist.destroy_process_group()


def estimate(shape: str, mode: str, tokens: int, world: int, ring: int = 1, task: str = "sft") -> tuple[float, float]:
    """The planner's (device bytes above the weights, host bytes) for the same step, the local
    kernel's workspace left out as the census leaves it out."""
    from hf_longctx.capacity.budget import step_budget
    from hf_longctx.capacity.budget_terms import KERNEL_TERM
    from hf_longctx.capacity.estimate import ModelDims
    from hf_longctx.capacity.search import preset_setting

    options, chunks = MODES[mode]
    if "memory" not in options:  # the planner ranks the presets only
        return float("nan"), float("nan")
    dims = ModelDims.from_config(config(shape))
    setting = preset_setting(world // ring, ring, chunks, options["memory"], dims)
    budget = step_budget(dims, setting, tokens=tokens, dtype="bf16", task=task)
    return max(p.total - p.terms.get(KERNEL_TERM, 0.0) for p in budget.phases), budget.host


def _print(args, rows) -> None:
    print(f"\nPer-token memory budget, one forward + backward, bf16, {args.world} gloo rank(s) "
          f"(Ulysses {args.world // args.ring} x ring {args.ring}), "
          "one document; device = peak above the weights (Census), host = pinned host buffers at their "
          "peak; 'vec' = hidden-size bf16 vectors per local token\n")
    print("| task | shape | mode | tokens | device B/token | device vec | planner vec | error | host B/token/layer | "
          "host vec/layer | planner host | error |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for shape, mode, tokens, r in rows:
        h = SHAPES[shape]["hidden_size"]
        vec = 2 * h
        dev_est, host_est = estimate(shape, mode, tokens, args.world, args.ring, r.get("task", "sft"))
        s_l, layers = r["s_local"], r["layers"]
        host = r["host"] / s_l / layers
        herr = f"{host_est / r['host'] - 1:+.1%}" if r["host"] else ("0" if not host_est else "n/a")
        if dev_est != dev_est:  # not a preset: no planner figure
            herr = "n/a"
        print(f"| {r.get('task', 'sft')} | {shape} | {mode} | {tokens} | {r['device'] / s_l:.0f} | {r['device'] / s_l / vec:.2f} | "
              f"{dev_est / s_l / vec:.2f} | {dev_est / r['device'] - 1:+.1%} | {host:.0f} | {host / vec:.2f} | "
              f"{host_est / s_l / layers / vec:.2f} | {herr} |")
    for shape, mode, tokens, r in rows:
        if tokens != max(args.tokens):
            continue
        vec = 2 * SHAPES[shape]["hidden_size"]
        print(f"\n{r.get('task', 'sft')} {shape} {mode} at {tokens} tokens: tensors alive at the device peak (vec per local token)")
        items = sorted(r["by_name"].items(), key=lambda kv: -kv[1])
        for (name, host), b in items[: args.top]:
            print(f"  {'host  ' if host else 'device'} {b / r['s_local'] / vec:6.3f}  {name}")
        if args.phases:
            for phase, (dev, by_name) in sorted(r["phases"].items(), key=lambda kv: -kv[1][0]):
                print(f"  phase {phase}: peak {dev / r['s_local'] / vec:.3f} vec")
                for (name, host), b in sorted(by_name.items(), key=lambda kv: -kv[1])[: args.top]:
                    if not host:
                        print(f"      {b / r['s_local'] / vec:6.3f}  {name}")


def main() -> None:
    from benchmarks._ranks import rows_of

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--ring", type=int, default=1, help="ring degree (Ulysses = world / ring)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--shapes", nargs="+", default=["A", "B"], choices=list(SHAPES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--tasks", nargs="+", default=["sft"], choices=["sft", "dpo", "grpo"],
                        help="the step counted: SFT's loss, or DPO's / GRPO's objective with the reference's forward")
    parser.add_argument("--top", type=int, default=14, help="named tensors listed per mode")
    parser.add_argument("--phases", action="store_true", help="also the peak of each phase of the step, with its tensors")
    args = parser.parse_args()
    rows = rows_of(_worker, args.world, args)
    _print(args, rows)


if __name__ == "__main__":
    main()
