"""patch(fused=True) against eager: kernels per layer, CPU step time, and the modelled GPU step.

Where it sits: a measurement of `integrations/fusion.py` (compiled norms, RoPE, gated-MLP
product, loss tail) through the patched step, one process (rank 0 of a one-rank world on
torch's fake process group: no collective), the CPU path (the aten CPU flash attention op).

1. Kernels per decoder layer, forward + backward: (4-layer − 2-layer) / 2 of the bf16 Llama of
   `benchmarks/hot_path.py` (hidden 64, 4 heads, 2 KV heads, one packed row of 4 documents, 64
   tokens), one step after two warm-ups, counted by `benchmarks/_launches.py` (aten ops that run
   a kernel, and inductor's generated kernels); per step: the 2-layer model's whole step.
2. CPU step seconds (median of 5 after the warm-ups; fp32, hidden 256, 4 layers, 1024 tokens),
   eager and fused side by side; the shared 2-core machine: nothing is asserted on them.
3. The step-time model (`capacity/inventory.py`, `roofline.py`): Llama-3.1-8B, 2 layers, one H100,
   32K tokens, per preset: launches, GEMM FLOPs and HBM bytes per token and layer, step seconds.

    PYTHONPATH=. python benchmarks/fused.py [--skip-time]
"""

from __future__ import annotations

import collections
import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._launches import kernel_records, step_launches  # noqa: E402

SETTINGS = {  # label -> patch options (fused added per column)
    "memory='off'": {},
    "memory='balanced'": {"memory": "balanced"},
    "memory='max'": {"memory": "max"},
    "balanced knobs, 3 row chunks": {"mlp_chunks": 3, "loss_chunks": 3},
    "max knobs, 3 row chunks": {"checkpoint": True, "mlp_chunks": 3, "loss_chunks": 3},
}
DOCS = [20, 12, 24, 8]


def one_rank_mesh():
    """The SP mesh of a one-rank world (call inside `_op_stream.fake_world(1)`)."""
    from hf_longctx.distributed.mesh import init_sequence_parallel

    return dataclasses.replace(init_sequence_parallel(1, 1), fpdt_chunks=1)


def _model(config, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _step_of(model, mesh, options: dict, fused: bool, docs: list):
    from benchmarks._op_stream import _batch
    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.integrations.model_patch import patch

    patch(model, mesh, **options, fused=fused).train()
    shard = shard_batch(_batch(sum(docs), model.config.vocab_size, docs), mesh)

    def step():
        model.zero_grad(set_to_none=True)
        model(**shard).loss.backward()

    return step


def step_counts(mesh, config, options: dict, fused: bool, docs=DOCS) -> collections.Counter:
    """Kernel launches of one bf16 fwd+bwd step of the patched model of `config` (two warm-ups:
    the compiles and lazy initialisations out of the count)."""
    with kernel_records():
        step = _step_of(_model(config, torch.bfloat16), mesh, options, fused, docs)
        step()
        step()
        return step_launches(step)


def layer_counts(mesh, options: dict, fused: bool) -> tuple[collections.Counter, collections.Counter]:
    """(launches per decoder layer by name, launches of the 2-layer step) of the hot-path Llama."""
    from benchmarks.hot_path import model_config

    lo, hi = (step_counts(mesh, model_config("llama", n), options, fused) for n in (2, 4))
    per = collections.Counter({k: (hi[k] - lo[k]) / 2 for k in set(lo) | set(hi) if hi[k] != lo[k]})
    return per, lo


def step_seconds(mesh, options: dict, fused: bool, steps: int = 5) -> float:
    from benchmarks._op_stream import llama

    config = llama(hidden=256, intermediate=688, heads=8, kv_heads=4, head_dim=32, vocab=2048, layers=4)
    step = _step_of(_model(config, torch.float32), mesh, options, fused, [256, 384, 128, 256])
    step()
    step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def modelled(preset: str, fused: bool, tokens: int = 1 << 15) -> dict:
    """Launches, GEMM FLOPs and HBM bytes per token and layer, and the step seconds, of
    Llama-3.1-8B (2 layers) on one H100 at `tokens` tokens under `preset`."""
    from transformers import LlamaConfig

    from hf_longctx.capacity.cluster import Cluster
    from hf_longctx.capacity.estimate import ModelDims
    from hf_longctx.capacity.inventory import layer_ops
    from hf_longctx.capacity.op_cost import Tally
    from hf_longctx.capacity.search import preset_setting
    from hf_longctx.capacity.step_time import shape_of, step_time

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256)
    dims = ModelDims.from_config(cfg)
    setting = dataclasses.replace(preset_setting(1, 1, 1, preset, dims), fused=fused)
    tally = Tally.of(layer_ops(shape_of(dims, setting, tokens)))
    cluster = Cluster(gpus=1, gpu_memory=80e9, host_memory=2e12, gpu="h100")
    return {"launches": sum(tally.launches.values()), "flops": sum(tally.flops.values()) / tokens,
            "bytes": sum(tally.bytes.values()) / tokens,
            "seconds": step_time(dims, setting, cluster, tokens).seconds}


def main(argv: list[str]) -> None:
    from benchmarks._op_stream import fake_world

    with fake_world(1):
        mesh = one_rank_mesh()
        print("Kernels per decoder layer (fwd + bwd) and per 2-layer step, bf16 Llama hidden 64, 64 tokens, CPU")
        print("| setting | per layer: eager | fused | disappear | per step: eager | fused |")
        print("|---|---:|---:|---:|---:|---:|")
        for label, options in SETTINGS.items():
            (e, e_step), (f, f_step) = (layer_counts(mesh, options, fused) for fused in (False, True))
            te, tf = sum(e.values()), sum(f.values())
            print(f"| {label} | {te:g} | {tf:g} | {te - tf:g} | {sum(e_step.values())} | {sum(f_step.values())} |")
        if "--skip-time" not in argv:
            print("\nCPU step seconds, fp32 Llama hidden 256, 4 layers, 1024 tokens (median of 5; shared 2-core machine)")
            print("| setting | eager s | fused s | fused / eager |")
            print("|---|---:|---:|---:|")
            for label, options in SETTINGS.items():
                e, f = (step_seconds(mesh, options, fused) for fused in (False, True))
                print(f"| {label} | {e:.3f} | {f:.3f} | {f / e:.2f} |")
    print("\nModelled: Llama-3.1-8B, 2 layers, one H100, 32K tokens (capacity/inventory.py + roofline.py)")
    print("| preset | launches per layer: eager | fused | GEMM+attention FLOPs/token/layer: eager | fused "
          "| HBM bytes/token/layer: eager | fused | step s: eager | fused |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for preset in ("off", "balanced", "high", "max"):
        e, f = modelled(preset, False), modelled(preset, True)
        print(f"| {preset} | {e['launches']:g} | {f['launches']:g} | {e['flops'] / 1e6:.1f} M | {f['flops'] / 1e6:.1f} M "
              f"| {e['bytes'] / 1e3:.1f} K | {f['bytes'] / 1e3:.1f} K | {e['seconds']:.3f} | {f['seconds']:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
