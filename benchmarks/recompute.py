"""What each checkpoint mode recomputes, counted, and what one training step costs with it.

Modes: no checkpointing, `checkpoint=True` (the whole decoder layer recomputed in the
backward, as ALST / HF gradient checkpointing do) and `checkpoint="attention"` (everything
but the core attention and its collectives recomputed: `integrations/checkpoint_attention.py`).

Part 1, counts (default): per layout (Ulysses 4, ring 2, U2xR2, FPDT u=2 on 4 gloo ranks) and
mode, on a tiny Llama (64 hidden, 8 heads / 4 KV heads, 2 and 4 layers, one packed row of 5
documents): attention forward kernel calls per layer per step (`ops.kernels.varlen_forward`),
collectives per layer per step (c10d ops seen by a TorchDispatchMode), FLOPs per step
(`torch.utils.flop_counter.FlopCounterMode`, 2-layer model), the peak of live tensor bytes
during the step (CPU: `torch.distributed._tools.mem_tracker.MemTracker`) and the bytes the
keep-attention mode holds for the attention (on the host where the device offloads; in place
on CPU). Per layer = (4-layer - 2-layer) / 2, rank 0. The FLOP target: keep-attention within
2 % of "no checkpoint + recompute of the non-attention parts" = none + (full - none -
attention forward FLOPs).

Part 2, `--time` (the targets' timing): 4 gloo ranks, Ulysses 4, one packed row of 32K
tokens (documents of 14K, 8K, 5K, 3K, 2K tokens + padding) through a tiny Llama (hidden 256,
8 heads / 4 KV heads, 2 layers, vocab 8K) with chunked MLP and loss, one full training step
(forward, backward, AdamW step) per mode, `--repeats` rounds with the three modes
interleaved inside each round; prints the median step time and peak memory of each mode and
the ratios. Each rank uses one thread (4 ranks on the machine's cores).

    PYTHONPATH=. python benchmarks/recompute.py                 # counts, ~1 min on 2 cores
    PYTHONPATH=. python benchmarks/recompute.py --time --repeats 3
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

MODES = (False, True, "attention")
MODE_NAMES = {False: "none", True: "full", "attention": "keep-attention"}
LAYOUTS = [  # (label, ulysses, ring, fpdt chunks)
    ("Ulysses 4", 4, 1, 1),
    ("ring 2", 2, 2, 1),  # ring 2 x ulysses 2 of the 4 ranks is U2xR2; ring-only needs ulysses 1
    ("U2xR2", 2, 2, 1),
    ("FPDT u=2 (U4)", 4, 1, 2),
]
DOCS_SMALL = [57, 23, 41, 9, 30]
DOCS_TIME = [14336, 8192, 5120, 3072, 2048]


class Collectives(TorchDispatchMode):
    """Counts c10d collectives (tests/distributed/test_checkpoint_attention.py uses it too)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _flop_mapping() -> dict:
    """FLOP formulas for the CPU flash-attention ops our CPU backend calls (torch's own sdpa
    formulas: FlopCounterMode has none registered for the `_for_cpu` variants)."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten

    def forward(query, key, value, *args, out_shape=None, **kwargs):
        return fc.sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
        return fc.sdpa_backward_flop_count(grad_out, query, key, value)

    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}


def _llama(layers: int, hidden: int, vocab: int):
    import transformers as tf

    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=max(DOCS_TIME) + 1))


def _batch(docs: list[int], vocab: int) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, sum(docs)), generator=g)
    pos = torch.cat([torch.arange(n) for n in docs])[None]  # [1, S] per-document positions
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}


def _kept_bytes(model) -> int:
    """Bytes the keep-attention mode holds for the attention at the end of one forward (its
    saved tensors and outputs, all layers), from the keeper's running count."""
    from hf_longctx.integrations.model_patch import patch_state

    keeper = patch_state(model).keeper
    return keeper.kept_bytes if keeper is not None else 0


def _count_step(mesh, mode, layers: int) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.integrations.model_patch import patch
    from hf_longctx.ops import kernels

    model = patch(_llama(layers, 64, 256), mesh, checkpoint=mode)
    model.train()
    shard = shard_batch(_batch(DOCS_SMALL, 256), mesh)
    model(**shard).loss.backward()  # warm-up (lazy initialisations out of the counts)
    model.zero_grad(set_to_none=True)
    from hf_longctx.integrations.model_patch import patch_state

    if patch_state(model).keeper is not None:
        patch_state(model).keeper.kept_bytes = 0  # count one step
    original, calls = kernels.varlen_forward, [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    kernels.varlen_forward = counted
    try:
        with Collectives() as coll, FlopCounterMode(display=False, custom_mapping=_flop_mapping()) as flops:
            model(**shard).loss.backward()
    finally:
        kernels.varlen_forward = original
    kept = _kept_bytes(model)
    model.zero_grad(set_to_none=True)
    return {"kernels": calls[0], "collectives": coll.n, "flops": flops.get_total_flops(),
            "peak": _peak_bytes(model, shard), "kept": kept}


def _attention_flops(mesh, layers: int) -> int:
    """FLOPs of the attention forward kernels of one step (counted inside varlen_forward)."""
    from torch.utils.flop_counter import FlopCounterMode

    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.integrations.model_patch import patch
    from hf_longctx.ops import kernels

    model = patch(_llama(layers, 64, 256), mesh)
    model.train()
    shard = shard_batch(_batch(DOCS_SMALL, 256), mesh)
    original, total = kernels.varlen_forward, [0]

    def counted(*args, **kwargs):
        with FlopCounterMode(display=False, custom_mapping=_flop_mapping()) as inner:
            out = original(*args, **kwargs)
        total[0] += inner.get_total_flops()
        return out

    kernels.varlen_forward = counted
    try:
        model(**shard).loss.backward()
    finally:
        kernels.varlen_forward = original
    return total[0]


def _peak_bytes(model, shard) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        model(**shard).loss.backward()
    model.zero_grad(set_to_none=True)
    return int(sum(tracker.get_tracker_snapshot("peak")[torch.device("cpu")].values()))


def _counts_worker(rank: int, init_file: str, args, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=4,
                            timeout=timedelta(minutes=20))
    from hf_longctx.distributed.mesh import init_sequence_parallel

    rows = []
    for label, u, r, chunks in LAYOUTS:
        if label == "ring 2":  # ring 2 alone: the 4 ranks as dp 2 x ring 2
            mesh = init_sequence_parallel(1, 2)
        else:
            mesh = init_sequence_parallel(u, r, fpdt_chunks=chunks)
        per_mode = {}
        for mode in MODES:
            lo, hi = _count_step(mesh, mode, 2), _count_step(mesh, mode, 4)
            per_mode[mode] = {"kernels": (hi["kernels"] - lo["kernels"]) / 2,
                              "collectives": (hi["collectives"] - lo["collectives"]) / 2,
                              "flops": lo["flops"], "peak": lo["peak"], "kept": lo["kept"]}
        per_mode["attention_fwd_flops"] = _attention_flops(mesh, 2)
        rows.append((label, per_mode))
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def _timed_step(model, shard, optimizer) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    model(**shard).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    return time.perf_counter() - t0


def _time_worker(rank: int, init_file: str, args, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=4,
                            timeout=timedelta(minutes=60))
    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.distributed.mesh import init_sequence_parallel
    from hf_longctx.integrations.model_patch import patch

    mesh = init_sequence_parallel(4, 1)
    base = _llama(2, 256, 8192)
    models, optims = {}, {}
    for mode in MODES:
        models[mode] = patch(copy.deepcopy(base), mesh, checkpoint=mode, mlp_chunks="auto", loss_chunks="auto")
        models[mode].train()
        optims[mode] = torch.optim.AdamW(models[mode].parameters(), lr=1e-4)
    shard = shard_batch(_batch(DOCS_TIME + [32768 - sum(DOCS_TIME)], 8192), mesh)
    times = {m: [] for m in MODES}
    peaks = {m: _peak_bytes(models[m], shard) for m in MODES}
    for _ in range(args.repeats):
        for mode in MODES:  # interleaved: machine noise hits every mode alike
            times[mode].append(_timed_step(models[mode], shard, optims[mode]))
    if rank == 0:
        results.put({m: (statistics.median(times[m]), times[m], peaks[m]) for m in MODES})
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    from benchmarks._ranks import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--time", action="store_true", help="the 32K-token timing instead of the counts")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.time:
        res = run_ranks(_time_worker, 4, args)
        full_t, full_p = res[True][0], res[True][2]
        print("| mode | step s (median) | runs | peak MiB (rank 0) | time / full | time / none | peak / full |")
        print("|---|---|---|---|---|---|---|")
        for m in MODES:
            t, runs, p = res[m]
            print(f"| {MODE_NAMES[m]} | {t:.2f} | {' '.join(f'{x:.2f}' for x in runs)} | {p / 2**20:.1f} | "
                  f"{t / full_t:.3f} | {t / res[False][0]:.3f} | {p / full_p:.3f} |")
        return
    rows = run_ranks(_counts_worker, 4, args)
    print("| layout | mode | attention fwd kernels / layer | collectives / layer | GFLOP / step | "
          "vs none + non-attention recompute | peak MiB | kept for attention MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for label, per in rows:
        none, full, attn_fwd = per[False], per[True], per["attention_fwd_flops"]
        target = none["flops"] + (full["flops"] - none["flops"] - attn_fwd)
        for m in MODES:
            c = per[m]
            vs = f"{c['flops'] / target:.3f}" if m == "attention" else ""
            print(f"| {label} | {MODE_NAMES[m]} | {c['kernels']:g} | {c['collectives']:g} | {c['flops'] / 1e9:.3f} | "
                  f"{vs} | {c['peak'] / 2**20:.2f} | {c['kept'] / 2**20:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
