"""What one decode step of `sp_generate` costs a GPU, counted on CPU: kernels, collectives, copies,
host syncs -- per attention layer and per step outside the layers.

Where it sits: beside `benchmarks/hot_path.py` (the training step's counts), with the same
instrument (`benchmarks/_counting.py`: provenance of every tensor, a host sync is a value read of
a device tensor, a blocking copy, a data-dependent shape). `sp_generate` decodes a packed rollout
(4 rows, no stop token, so every row runs every step) on `--world` gloo ranks; the counts of the
whole call are taken at two completion lengths and two layer counts, so
    per layer and step = ((c[4 layers, 6 new] - c[4, 4]) - (c[2, 6] - c[2, 4])) / 2 / 2,
    per step outside the layers = (c[2, 6] - c[2, 4]) / 2 - 2 x per layer
(the prefill and the one-off set-up cancel). The baseline is transformers' `generate` of the
unpatched model on the same rows in one process (sdpa, its DynamicCache), counted the same way.
The CUDA path of the prefill's local attention is forced as in hot_path.py; the decode attention
(`ops/decode_attention.py`) runs the same torch ops on every device.

    PYTHONPATH=. python benchmarks/decode_cost.py [--world 4]
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._counting import Counter  # noqa: E402
from benchmarks.hot_path import CATEGORIES, _model, forced_cuda_path  # noqa: E402

PROMPTS = [[5, 17, 42, 9, 11, 3, 60], [8, 8, 31], [60, 2, 77, 14, 90, 21, 4, 4, 19, 33, 7], [12, 40]]
NEW = (4, 6)  # completion lengths counted: their difference is two decode steps
# (label, ulysses, ring) on `--world` ranks; a layout whose degrees do not match the world is skipped
LAYOUTS = [("1 process", 1, 1), ("U2", 2, 1), ("R2", 1, 2), ("U4", 4, 1), ("U2xR2", 2, 2), ("R4", 1, 4)]


def sp_counts(mesh, layers: int, new: int) -> dict:
    """`sp_generate` of PROMPTS on this rank, counted (collective: every rank calls it)."""
    from hf_longctx.generation.loop import sp_generate
    from hf_longctx.integrations.model_patch import patch

    model = _model("llama", layers)
    counter = Counter()
    with forced_cuda_path(counter), counter.tracking():
        counter.mark_module(model)
        patch(model, mesh)
        sp_generate(model, PROMPTS, mesh, max_new_tokens=2, eos_token_id=[], pad_token_id=0, log=None)  # warm-up
        counter.reset()
        with counter.counting():
            sp_generate(model, PROMPTS, mesh, max_new_tokens=new, eos_token_id=[], pad_token_id=0, log=None)
    return counter.snapshot()


def hf_counts(layers: int, new: int) -> dict:
    """transformers' generate of the unpatched model on PROMPTS (left-padded batch), counted."""
    model = _model("llama", layers).eval()
    width = max(len(p) for p in PROMPTS)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = (ids != 0).long()
    counter = Counter()
    with counter.tracking():
        counter.mark_module(model)
        counter.mark_device(ids, mask)
        kw = dict(attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=0)
        model.generation_config.eos_token_id = None
        model.generate(ids, max_new_tokens=2, **kw)
        counter.reset()
        with counter.counting():
            model.generate(ids, max_new_tokens=new, **kw)
    return counter.snapshot()


def split(count, layers: tuple[int, int] = (2, 4), new: tuple[int, int] = NEW) -> tuple[dict, dict]:
    """(per layer and step, per step outside the layers) from `count(layers, new)`, counted at two
    layer counts and two completion lengths (the docstring's formula; the tests count smaller ones)."""
    (l0, l1), (n0, n1) = layers, new
    c = {(n_layers, n_new): count(n_layers, n_new) for n_layers in layers for n_new in new}
    steps = n1 - n0
    layer = {k: ((c[l1, n1][k] - c[l1, n0][k]) - (c[l0, n1][k] - c[l0, n0][k])) / (l1 - l0) / steps
             for k in CATEGORIES}
    step = {k: (c[l0, n1][k] - c[l0, n0][k]) / steps - l0 * layer[k] for k in CATEGORIES}
    return layer, step


def _worker(rank: int, init_file: str, args, results) -> None:
    import torch.distributed as dist

    from hf_longctx.distributed.mesh import init_sequence_parallel

    torch.set_num_threads(1)
    if args.world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.world,
                                timeout=timedelta(minutes=10))
    rows = []
    for label, u, r in LAYOUTS:
        if u * r != args.world:
            continue
        mesh = init_sequence_parallel(u, r)
        rows.append((label, *split(lambda layers, new: sp_counts(mesh, layers, new))))
    if rank == 0:
        if args.world == 1:
            rows.append(("transformers generate (unpatched)", *split(hf_counts)))
        results.put(rows)
    if args.world > 1:
        dist.destroy_process_group()


def main() -> None:
    from benchmarks._ranks import rows_of

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=1, help="gloo ranks (one SP group)")
    args = parser.parse_args()
    rows = rows_of(_worker, args.world, args)
    print(f"\nOne decode step of {len(PROMPTS)} rows, rank 0 of {args.world}, counted on CPU as a GPU pays it "
          "(benchmarks/_counting.py)\n")
    print("| layout | per layer: kernels | collectives | h2d | d2h | syncs | per step outside layers: kernels | "
          "collectives | h2d | d2h | syncs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, layer, step in rows:
        cells = [f"{layer[k]:g}" for k in CATEGORIES] + [f"{step[k]:g}" for k in CATEGORIES]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
