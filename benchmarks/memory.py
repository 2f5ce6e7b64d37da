"""Peak memory of one training step: plain USP vs the FPDT memory features, as one ablation table.

Where it sits: outside the library; it drives the public path (`init_sequence_parallel`,
`patch`, `shard_batch`) on 2 gloo ranks of this machine and measures, per rank, the peak
tensor memory of one step (forward, backward, SGD step) with
`torch.distributed._tools.mem_tracker.MemTracker`. It quantifies FPDT (FPDT paper §3.3-3.5):
chunked loss, chunked MLP, FPDT attention chunks (with K/V offload, a no-op copy on CPU) and
offloaded checkpointing, each added on top of the previous row.

Second part: the longest sequence whose step fits a fixed per-rank budget (default: the peak
of plain USP at --budget-tokens). Peak memory is linear in the tokens for every row
(attention is a flash-style kernel), so each setting is measured at two lengths, the line
through them is solved for the budget, and the answer is re-measured when it is at most
--verify-limit tokens (attention is quadratic in time, so longer ones are not run on CPU).
Fit points lie where every loss chunk has its full (floor) length, so the line is exact.

GPU figures (pinned-host offload, side-stream prefetch): not measured -- no GPU here.

The table ends with the `patch(memory=...)` presets: "max" against the all-features row,
"balanced" against plain USP's step time.

Run: PYTHONPATH=. python benchmarks/memory.py            (about 10 minutes on 2 CPU cores)
     PYTHONPATH=. python benchmarks/memory.py --no-fit   (the ablation table with the presets only)
     PYTHONPATH=. python benchmarks/memory.py --tokens 4096 --budget-tokens 2048 --verify-limit 0   (quick)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from benchmarks._ranks import run_ranks

WORLD = 2  # Ulysses degree = world size: 16K tokens on 2 ranks
FPDT_CHUNKS = 4

ROWS = [  # (label, options); each row adds one feature to the one above
    ("plain USP", dict()),
    ("+ chunked loss", dict(loss=True)),
    ("+ chunked MLP", dict(loss=True, mlp=True)),
    ("+ FPDT chunks (u=4)", dict(loss=True, mlp=True, fpdt=True)),
    ("+ checkpoint offload", dict(loss=True, mlp=True, fpdt=True, checkpoint=True)),
]
PRESET_ROWS = [  # patch(memory=...) presets; "max" on the FPDT mesh of the all-features row
    ("memory='balanced'", dict(preset="balanced")),
    ("memory='max' (u=4)", dict(preset="max", fpdt=True)),
]


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
        vocab_size=32000, max_position_embeddings=1 << 20, attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg)


def _batch(tokens: int, vocab: int) -> dict:
    """One packed row of four documents (DataCollatorWithFlattening style)."""
    g = torch.Generator().manual_seed(1)
    docs = [tokens // 4] * 3 + [tokens - 3 * (tokens // 4)]
    ids = torch.randint(0, vocab, (1, tokens), generator=g)
    pos = torch.cat([torch.arange(n) for n in docs])[None]  # [1, S] per-document positions
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}


def _measure(base_mesh, opts: dict, tokens: int, loss_chunk_tokens: int) -> tuple[int, float]:
    """(peak bytes of one tracked step, seconds of one untracked step) on this rank."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.integrations.model_patch import patch
    from hf_longctx.ops.loss_rows import config_sizes, memory_rows
    from hf_longctx.ops.tiling import default_mlp_chunks

    mesh = dataclasses.replace(base_mesh, fpdt_chunks=FPDT_CHUNKS if opts.get("fpdt") else 1)
    model = _model()
    s_local = tokens // WORLD
    chunk = loss_chunk_tokens or memory_rows(*config_sizes(model.config), s_local)  # the memory rule's chunk
    loss_chunks = math.ceil(s_local / min(chunk, s_local)) if opts.get("loss") else None
    if opts.get("preset"):
        patch(model, mesh, memory=opts["preset"])
    else:
        patch(
            model, mesh, kv_offload=bool(opts.get("fpdt")), checkpoint=bool(opts.get("checkpoint")),
            mlp_chunks=default_mlp_chunks(FPDT_CHUNKS) if opts.get("mlp") else None, loss_chunks=loss_chunks,
        )
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)  # stateless: the table is about activations
    shard = shard_batch(_batch(tokens, model.config.vocab_size), mesh)

    def step():
        model(**shard).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: lazy initialisations out of the measurement
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step()
    peak = max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    dist.barrier()
    t0 = time.perf_counter()
    step()
    dist.barrier()
    return peak, time.perf_counter() - t0


def _worker(rank: int, init_file: str, args, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timedelta(minutes=30))
    from hf_longctx.distributed.mesh import init_sequence_parallel

    mesh = init_sequence_parallel(WORLD, 1)

    def run(opts, tokens):
        peak, secs = _measure(mesh, opts, tokens, args.loss_chunk_tokens)
        both = [None] * WORLD
        dist.all_gather_object(both, (peak, secs))
        peak, secs = max(p for p, _ in both), max(s for _, s in both)  # the worst rank decides
        if rank == 0:
            print(f"  measured {opts or 'plain'} at {tokens} tokens: {peak / 2**20:.1f} MiB, {secs:.2f} s", flush=True)
        return peak, secs

    table = [(label, *run(opts, args.tokens)) for label, opts in ROWS + PRESET_ROWS]
    if args.no_fit:
        if rank == 0:
            results.put((table, None, None))
        dist.destroy_process_group()
        return
    # Both fit points in the linear regime: every loss chunk at its full length (the floor).
    plain_lo, plain_hi = run(ROWS[0][1], args.budget_tokens // 2)[0], run(ROWS[0][1], args.budget_tokens)[0]
    budget = args.budget or plain_hi
    fits = []
    for (label, opts), (lo, hi) in zip(
        (ROWS[0], ROWS[-1]), ((args.budget_tokens // 2, args.budget_tokens), (args.budget_tokens, 2 * args.budget_tokens))
    ):
        p_lo, p_hi = (plain_lo, plain_hi) if label == ROWS[0][0] else (run(opts, lo)[0], run(opts, hi)[0])
        per_token = (p_hi - p_lo) / (hi - lo)
        multiple = 4 * WORLD * FPDT_CHUNKS  # four documents, FPDT layout
        longest = int((budget - p_lo) / per_token + lo) // multiple * multiple
        # Measure the fitted length itself, or the longest length CPU time allows: a measured
        # point under the budget is a proven lower bound on the longest sequence that fits.
        at = min(longest, args.verify_limit // multiple * multiple)
        checked = (at, run(opts, at)[0]) if at >= lo else None
        fits.append((label, longest, checked))
    if rank == 0:
        results.put((table, budget, fits))
    dist.destroy_process_group()


def _print(args, table, budget, fits) -> None:
    mib = 1 << 20
    plain_peak, plain_time = table[0][1], table[0][2]
    loss_peak = table[1][1]
    print(f"\nOne training step, tiny Llama (hidden 256, inter 688, 2 layers, 8 heads / 4 KV, vocab 32000), "
          f"{args.tokens} tokens on {WORLD} gloo ranks (Ulysses {WORLD}); peak tensor memory per rank (MemTracker, worst rank); "
          f"loss chunk: {args.loss_chunk_tokens or 'library default'} tokens\n")
    print("| setting | CPU peak MiB | x plain USP | x (+ chunked loss) | CPU step s | x plain time | GPU peak | GPU step |")
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for label, peak, secs in table:
        print(f"| {label} | {peak / mib:.1f} | {peak / plain_peak:.3f} | {peak / loss_peak:.3f} | {secs:.2f} | "
              f"{secs / plain_time:.2f} | not measured | not measured |")
    rows = {label: (peak, secs) for label, peak, secs in table}
    all_on, balanced, top = rows[ROWS[-1][0]], rows[PRESET_ROWS[0][0]], rows[PRESET_ROWS[1][0]]
    print(f"\npresets: memory='max' peak = {top[0] / all_on[0]:.3f}x the all-features row (target within 5%); "
          f"memory='balanced' step time = {balanced[1] / plain_time:.2f}x plain (target <= 1.1), "
          f"peak {balanced[0] / plain_peak:.3f}x plain")
    if fits is None:
        return
    table = table[: len(ROWS)]
    print(f"| longest sequence within {budget / mib:.1f} MiB/rank (plain USP peak at {args.budget_tokens} tokens) "
          "| fitted tokens | measured at tokens | measured peak MiB | | | | |")
    for label, longest, checked in fits:
        at, peak = checked if checked is not None else ("not run", None)
        shown = f"{peak / mib:.1f}" if peak is not None else "-"
        name = "all on" if label != ROWS[0][0] else label
        print(f"| {name} | {longest} | {at} | {shown} | | | | |")
    ratio = fits[1][1] / max(1, fits[0][1])
    proven = [c for c in (fits[1][2],) if c is not None and c[1] <= budget]
    if proven:
        print(f"measured: all on holds {proven[0][0]} tokens within the budget = "
              f"{proven[0][0] / max(1, fits[0][1]):.1f}x plain's longest (a lower bound; the fit says {ratio:.1f}x)")
    print(f"\nall on vs plain: peak {table[-1][1] / plain_peak:.3f}x (target <= 0.35), "
          f"{table[-1][1] / loss_peak:.3f}x of +chunked loss (target <= 0.6), "
          f"time {table[-1][2] / plain_time:.2f}x (target <= 1.25); longest sequence {ratio:.1f}x by the linear fit "
          "(goal >= 4; the measured lower bound is the line above)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="packed tokens of the ablation step")
    parser.add_argument("--budget-tokens", type=int, default=4096, help="budget = plain USP's peak at this length")
    parser.add_argument("--budget", type=int, default=0, help="explicit per-rank budget in bytes (overrides the above)")
    parser.add_argument("--verify-limit", type=int, default=65536, help="re-measure fitted lengths up to this")
    parser.add_argument("--loss-chunk-tokens", type=int, default=0, help="tokens per loss chunk (0: library default)")
    parser.add_argument("--no-fit", action="store_true", help="only the ablation table (with the memory presets)")
    args = parser.parse_args()
    table, budget, fits = run_ranks(_worker, WORLD, args)
    _print(args, table, budget, fits)


if __name__ == "__main__":
    main()
