"""Validate the planner's memory model (`hf_longctx.capacity.estimate`) against measured peaks.

Where it sits: outside the library. For a tiny Llama on CPU, ONE process (mesh degree 1,
world 1, fp32, AdamW), it runs one training step (forward, backward, AdamW step) per
configuration under `torch.distributed._tools.mem_tracker.MemTracker` -- after one warm-up
step, so AdamW's moments exist as in steady state -- and prints the measured peak next to
`estimate_memory(...)` for exactly that configuration (FPDT §3-4 memory analysis).

On CPU there is no separate host memory: the checkpoint's saved layer inputs (and FPDT's
K/V chunks) stay where they are, read in place, so the estimate is taken with `offload=False`.
The planner budgets flash-attn 2's backward workspace (fp32 dq accumulator, GQA dK/dV over the
query heads); the CPU kernel (`ops/backends/aten_cpu.py` tile by tile, `tiled.py`) needs more:
K/V expanded to the query heads, every tile's fp32 dq/dK/dV until they are assembled, dK/dV
over the query heads before the GQA sum. A third step counts that workspace (what one kernel
call allocates beyond what it returns, `benchmarks/census.Census`), and the table shows the
estimate with flash-attn 2's workspace and with the measured CPU one (`kernel_workspace=`).

GPU peaks (torch.cuda.max_memory_allocated, bf16) are measured with `--device cuda` when a
GPU is available; without one the table says so.

Run: PYTHONPATH=. python benchmarks/memory_model.py                 (a few minutes, 2 cores)
     PYTHONPATH=. python benchmarks/memory_model.py --tokens 2048 8192
"""

from __future__ import annotations

import argparse
import time

import torch

ROWS = [  # (label, patch options, Setting fields)
    ("plain", dict(), dict()),
    ("chunked loss", dict(loss_chunks="auto"), dict(loss_chunks=0)),
    ("chunked loss + MLP", dict(loss_chunks="auto", mlp_chunks=4), dict(loss_chunks=0, mlp_chunks=4)),
    ("checkpointing + chunked loss/MLP", dict(loss_chunks="auto", mlp_chunks=4, checkpoint=True),
     dict(loss_chunks=0, mlp_chunks=4, checkpoint=True)),
    # Many loss chunks: the recomputed layer in backward, not the loss, sets the peak.
    ("checkpointing + 32 loss chunks + MLP", dict(loss_chunks=32, mlp_chunks=4, checkpoint=True),
     dict(loss_chunks=32, mlp_chunks=4, checkpoint=True)),
    ("FPDT u=4 + KV offload + chunked loss/MLP", dict(kv_offload=True, loss_chunks="auto", mlp_chunks=8),
     dict(fpdt_chunks=4, kv_offload=True, loss_chunks=0, mlp_chunks=8)),
]


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        vocab_size=8192, max_position_embeddings=1 << 20,
    )


def measure(options: dict, tokens: int, device: str, dtype: torch.dtype) -> int:
    """Peak bytes of one tracked training step after a warm-up step."""
    from transformers import LlamaForCausalLM

    from hf_longctx import init_sequence_parallel, patch, shard_batch

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config()).to(device=device, dtype=dtype)
    mesh = init_sequence_parallel(1, 1, fpdt_chunks=4 if options.get("kv_offload") else 1)
    patch(model, mesh, **options)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=g)
    pos = torch.cat([torch.arange(tokens // 4)] * 4)[None]  # four packed documents
    shard = shard_batch({"input_ids": ids, "labels": ids.clone(), "position_ids": pos}, mesh)
    shard = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in shard.items()}

    def step() -> None:
        model(**shard).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated()), None
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step()
    peak = int(max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values()))
    return peak, kernel_workspace(step)


def kernel_workspace(step) -> int:
    """The most one local attention kernel call holds beyond the tensors it returns, in one step."""
    from benchmarks.census import Census
    from hf_longctx.ops import kernels

    census, worst = Census(), [0]
    saved = kernels.varlen_forward, kernels.varlen_backward

    def wrap(fn):
        def call(*args, **kwargs):
            census.kernel_peak = census.kernel_now
            with census.kernel():
                out = fn(*args, **kwargs)
            returned = sum(t.untyped_storage().nbytes() for t in out if isinstance(t, torch.Tensor))
            worst[0] = max(worst[0], census.kernel_peak - returned)
            return out
        return call

    kernels.varlen_forward, kernels.varlen_backward = (wrap(f) for f in saved)
    try:
        with census:
            step()
    finally:
        kernels.varlen_forward, kernels.varlen_backward = saved
    return worst[0]


def estimate(setting_fields: dict, tokens: int, dtype: str, *, host_is_device: bool,
             kernel: float | None = None) -> float:
    """The planner's peak; `kernel`: a measured kernel workspace instead of flash-attn 2's."""
    from hf_longctx.capacity.estimate import ModelDims, Setting, estimate_memory

    est = estimate_memory(
        ModelDims.from_config(tiny_config()), Setting(ulysses=1, ring=1, **setting_fields),
        world=1, tokens=tokens, dtype=dtype, optimizer="adamw", offload=not host_is_device, kernel_workspace=kernel,
    )
    return est.peak


def main(argv: list[str] | None = None) -> list[tuple]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    cuda = args.device == "cuda"
    dtype_name = "bf16" if cuda else "fp32"
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    mib = 1 << 20
    c = tiny_config()
    print(f"\nTiny Llama (hidden {c.hidden_size}, inter {c.intermediate_size}, {c.num_hidden_layers} layers, "
          f"{c.num_attention_heads} heads / {c.num_key_value_heads} KV, vocab {c.vocab_size}), one process, {dtype_name}, "
          f"AdamW; peak of one step ({'torch.cuda.max_memory_allocated' if cuda else 'MemTracker'}) vs estimate\n")
    print("| setting | tokens | measured MiB | estimated MiB (flash-attn 2 workspace) | error | "
          "CPU kernel workspace MiB (measured) | estimated MiB with it | error | run s (build + 3 steps) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for tokens in args.tokens:
        for label, options, fields_ in ROWS:
            t0 = time.perf_counter()
            peak, kernel = measure(options, tokens, args.device, dtype)
            secs = time.perf_counter() - t0
            est = estimate(fields_, tokens, dtype_name, host_is_device=not cuda)
            err = est / peak - 1
            cpu = ("n/a", est, err) if kernel is None else (
                f"{kernel / mib:.1f}", e := estimate(fields_, tokens, dtype_name, host_is_device=True, kernel=kernel),
                e / peak - 1)
            rows.append((label, tokens, peak, est, err, cpu[2]))
            print(f"| {label} | {tokens} | {peak / mib:.1f} | {est / mib:.1f} | {err:+.1%} | {cpu[0]} | "
                  f"{cpu[1] / mib:.1f} | {cpu[2]:+.1%} | {secs:.1f} |", flush=True)
    print(f"\nworst |error| = {max(abs(r[4]) for r in rows):.1%} with flash-attn 2's workspace, "
          f"{max(abs(r[5]) for r in rows):.1%} with the measured kernel workspace (target 10%)")
    return rows


if __name__ == "__main__":
    main()
