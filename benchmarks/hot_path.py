"""Hot-path costs per decoder layer on the CUDA dispatch path, counted on CPU.

Where it sits: a measurement of the whole patched step (`integrations/model_patch.patch`,
`ops/usp.py`, `ops/ring.py`, `ops/fpdt.py`, `ops/backends/packed.py`, the linear mixers of
`ops/mixers/`, the offload of `ops/offload.py` and `integrations/checkpointing.py`) with the
local attention forced onto the varlen (flash-attn 2.8 API) backend of
`ops/backends/select.py`, whose kernel is the CPU emulation of `tests/helpers/emulated_backends.py`,
and every host offload on its CUDA branch with stub streams. Nothing is timed:
`benchmarks/_counting.py` counts what a GPU would pay -- kernel-like ops, collectives,
host<->device copies and host SYNCS -- with every CPU-side tensor treated as host unless it
is the device copy, the backward run by the autograd engine with the counters on.

Per layer = (count of a 4-layer model - count of a 2-layer model) / 2, one fwd+bwd step
after a warm-up step, rank 0; "per step" = what the step pays outside its layers (the
2-layer count minus two layers: sharding checks, loss, transformers' mask creation). A
hybrid model alternates a linear-mixer layer and an attention layer, so its "per layer"
is the mean of the two. The unpatched model (sdpa, the whole sequence on one process)
gives the baseline ops per layer.

    PYTHONPATH=. python benchmarks/hot_path.py [--ops]
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._counting import Counter  # noqa: E402
from benchmarks._stubs import CountedKernel, stub_offload  # noqa: E402

# (label, ulysses, ring, fpdt chunks, patch options, model family); world = ulysses x ring
LAYOUTS = [
    ("U2", 2, 1, 1, {}, "llama"),
    ("R2", 1, 2, 1, {}, "llama"),
    ("U2xR2", 2, 2, 1, {}, "llama"),
    ("FPDT u=2 (U2)", 2, 1, 2, {}, "llama"),
    ("FPDT u=2 + KV offload (U2)", 2, 1, 2, {"kv_offload": True}, "llama"),
    ("memory='balanced' (U2)", 2, 1, 1, {"memory": "balanced"}, "llama"),
    ("memory='high' (U2, u=2)", 2, 1, 2, {"memory": "high"}, "llama"),
    ("memory='max' (U2, u=2)", 2, 1, 2, {"memory": "max"}, "llama"),
    ("memory='max' + keep_attention (U2, u=2)", 2, 1, 2, {"memory": "max", "keep_attention": True}, "llama"),
    ("conv: LFM2 (U2)", 2, 1, 1, {}, "lfm2"),
    ("GDN: Qwen3.5 (U2)", 2, 1, 1, {}, "qwen3_5"),
    ("Mamba-2: Bamba (U2)", 2, 1, 1, {}, "bamba"),
    ("RG-LRU: RecurrentGemma (R2)", 1, 2, 1, {}, "recurrent_gemma"),
    ("GDN state passing: Qwen3.5 (U2xR2)", 2, 2, 1, {"mixers": "state"}, "qwen3_5"),
    ("Mamba-2 state passing: Nemotron-H (U2xR2)", 2, 2, 1, {"mixers": "state"}, "nemotron_h"),
]
DOCS = [20, 12, 24, 8]  # one packed row of 64 tokens
TARGETS = {"ulysses": 1.25, "ring": 1.6}  # ops per layer / unpatched, plain attention layouts
CATEGORIES = ("kernels", "collectives", "h2d", "d2h", "syncs")


def model_config(family: str, layers: int):
    import transformers as tf

    small = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    pairs = layers // 2  # hybrids: (linear mixer, attention) pairs
    if family == "lfm2":
        return tf.Lfm2Config(**small, layer_types=["conv", "full_attention"] * pairs, conv_L_cache=3)
    if family == "qwen3_5":
        return tf.Qwen3_5TextConfig(**small, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                                    layer_types=["linear_attention", "full_attention"] * pairs)
    if family == "bamba":
        return tf.BambaConfig(**small, attn_layer_indices=list(range(1, layers, 2)), mamba_n_heads=4, mamba_n_groups=2,
                              mamba_d_head=32, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16)
    if family == "recurrent_gemma":
        return tf.RecurrentGemmaConfig(**small, lru_width=64, attention_window_size=64, conv1d_width=4,
                                       block_types=("recurrent", "attention"))
    if family == "nemotron_h":
        return tf.NemotronHConfig(**{k: v for k, v in small.items() if k != "num_hidden_layers"}, head_dim=16,
                                  layers_block_type=["mamba", "attention"] * pairs, ssm_state_size=16,
                                  mamba_num_heads=4, mamba_head_dim=16, n_groups=2, conv_kernel=4, chunk_size=16)
    return tf.LlamaConfig(**small, head_dim=16)


def _model(family: str, layers: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = model_config(family, layers)
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)


def _batch() -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (1, sum(DOCS)), generator=g)
    pos = torch.cat([torch.arange(n) for n in DOCS])[None]  # [1, S] per-document positions
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}


def _on_device(counter: Counter, model, batch: dict) -> None:
    """The model and the batch live on the device (what `to_device` / FSDP2 would have done)."""
    counter.mark_module(model)
    counter.mark_device([v for v in batch.values() if isinstance(v, torch.Tensor)])


def _counted_step(counter: Counter, model, batch: dict) -> dict:
    model(**batch).loss.backward()  # warm-up: lazy initialisations and per-batch caches out of the count
    model.zero_grad(set_to_none=True)
    counter.reset()
    with counter.counting():
        model(**batch).loss.backward()
    return counter.snapshot()


@contextlib.contextmanager
def forced_cuda_path(counter: Counter):
    """Local attention on the packed flash-attn 2.8 backend with the emulated kernel; a
    weight-gradient GEMM of bf16 operands into its fp32 sum counted as the one kernel CUDA runs
    (`ops/grad_sums.accumulate_mm_`: CPU widens the operands, CUDA's GEMM takes the sum as C)."""
    from hf_longctx.ops import grad_sums, kernels
    from hf_longctx.ops.backends.packed import PackedBackend
    from tests.helpers.emulated_backends import cuda_env

    env, _ = cuda_env(flash="2.8.3", torch_ops=False)
    backend = PackedBackend("flash_attn", CountedKernel(env.flash_attn, counter))
    old, old_gemm = kernels.backend_for, grad_sums.accumulate_mm_

    def one_gemm(acc, a, b, fresh=False):
        if a.dtype == acc.dtype:
            return old_gemm(acc, a, b, fresh)
        with counter.opaque():
            old_gemm(acc, a, b, fresh)
        if counter.active:
            counter.kernel_names["baddbmm"] += 1
            # its operands as CUDA's GEMM reads them: a, b and (beta 1) the sum; it writes the sum
            operands = (a[None], b[None]) if fresh else (acc[None], a[None], b[None])
            counter.record("kernels", torch.ops.aten.bmm.default if fresh else torch.ops.aten.baddbmm.default,
                           operands, {}, acc[None])

    kernels.backend_for = lambda q, *, softcap, mask=False, **_: backend
    grad_sums.accumulate_mm_ = one_gemm
    try:
        yield
    finally:
        kernels.backend_for, grad_sums.accumulate_mm_ = old, old_gemm


def patched_counts(mesh, options: dict, family: str, layers: int) -> dict:
    """One fwd+bwd step of the patched model on this rank (collective: every rank calls it)."""
    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.integrations.model_patch import patch

    model = _model(family, layers)
    counter = Counter()
    with stub_offload(counter), forced_cuda_path(counter), counter.tracking():
        counter.mark_module(model)
        patch(model, mesh, **options)  # tracked: anything it builds is host unless put on the device
        model.train()
        shard = shard_batch(_batch(), mesh)
        _on_device(counter, model, shard)
        return _counted_step(counter, model, shard)


def saved_bytes(mesh, options: dict, family: str, layers: int) -> int:
    """Bytes of the distinct storages autograd keeps for the backward after one patched forward
    on this rank (a saved view keeps its whole buffer alive, so it counts whole)."""
    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.integrations.model_patch import patch

    model = _model(family, layers)
    patch(model, mesh, **options)
    model.train()
    kept: dict = {}

    def pack(t: torch.Tensor):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    counter = Counter()
    with forced_cuda_path(counter), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**shard_batch(_batch(), mesh)).loss
    del loss
    return sum(kept.values())


def unpatched_counts(family: str, layers: int) -> dict:
    model = _model(family, layers)
    model.train()
    counter = Counter()
    batch = _batch()
    with counter.tracking():
        _on_device(counter, model, batch)
        return _counted_step(counter, model, batch)


def per_layer(lo: dict, hi: dict, span: int = 2) -> dict:
    return {k: (hi[k] - lo[k]) / span for k in CATEGORIES}


def _diff(lo: collections.Counter, hi: collections.Counter, span: int = 2) -> dict:
    return {s: (hi[s] - lo[s]) / span for s in set(hi) | set(lo) if hi[s] != lo[s]}


def layout_costs(label: str, mesh, *, baseline: bool = True) -> dict:
    """Per-layer (and per-step) costs of one layout on this rank; `mesh` matches the layout's
    degrees. `baseline`: also count the unpatched model (the ratio column)."""
    _, _, _, _, options, family = next(row for row in LAYOUTS if row[0] == label)
    lo, hi = (patched_counts(mesh, options, family, n) for n in (2, 4))
    out = per_layer(lo, hi)
    out["step"] = {k: lo[k] - 2 * out[k] for k in CATEGORIES}  # outside the layers
    sites_lo, sites_hi = collections.Counter(lo["sync_sites"]), collections.Counter(hi["sync_sites"])
    out["sync_sites"] = _diff(sites_lo, sites_hi)  # per layer
    out["step_sync_sites"] = {s: n - 2 * out["sync_sites"].get(s, 0) for s, n in sites_lo.items()
                              if n - 2 * out["sync_sites"].get(s, 0)}
    out["kernel_names"] = _diff(lo["kernel_names"], hi["kernel_names"])  # per layer
    if not options.get("memory") and not options.get("checkpoint"):  # checkpointing keeps tensors its own way
        tokens = sum(DOCS) // mesh.sp
        out["saved"] = (saved_bytes(mesh, options, family, 4) - saved_bytes(mesh, options, family, 2)) / 2 / tokens
    if baseline:
        base_lo, base_hi = unpatched_counts(family, 2), unpatched_counts(family, 4)
        out["unpatched"] = per_layer(base_lo, base_hi)["kernels"]
        out["unpatched_names"] = _diff(base_lo["kernel_names"], base_hi["kernel_names"])
    return out


def _unfused_merge(out, lse, block_out, block_lse):
    """The merge as the ring ran it before `lse.merge_`: the block widened to float32 by the
    backend, then two weighted copies summed into a fresh result."""
    block_out = block_out.to(torch.float32)
    new_lse = torch.logaddexp(lse, block_lse)
    ref = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_old, w_new = torch.exp(lse - ref).unsqueeze(-1), torch.exp(block_lse - ref).unsqueeze(-1)
    return w_old * out.to(torch.float32) + w_new * block_out.to(torch.float32), new_lse


def merge_costs(shape=(1, 8, 4096, 128)) -> dict[str, tuple[int, int]]:
    """(full-size temporaries, full-size passes) of folding one bf16 block [B, H, S, D] into a
    float32 accumulator: ops allocating a [B, H, S, D] tensor that is not the caller's result,
    and [B, H, S, D] operands read or written (each a pass over the memory; an in-place one
    counts twice). Meta tensors: shapes only."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_longctx.ops import lse as lse_ops

    numel = torch.Size(shape).numel()

    class Passes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.allocs = self.passes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            full = [t for t in (*args, *(kwargs or {}).values()) if isinstance(t, torch.Tensor) and t.numel() == numel]
            outs = [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
            fresh = [t for t in outs if t.numel() == numel and not func.is_view and not func._schema.is_mutable]
            self.allocs += len(fresh)
            written = func._schema.is_mutable and isinstance(args[0], torch.Tensor) and args[0].numel() == numel
            self.passes += len(full) + len(fresh) + written  # an in-place operand is read and written
            return out

    def acc():
        return torch.empty(shape, device="meta", dtype=torch.float32)

    def run(fn):
        out, block = acc(), torch.empty(shape, device="meta", dtype=torch.bfloat16)
        lse, block_lse = (torch.empty(shape[:-1], device="meta") for _ in range(2))
        with Passes() as p:
            fn(out, lse, block, block_lse)
        return p.allocs, p.passes

    before = run(_unfused_merge)
    return {
        "before: block widened, w_old·out + w_new·block": (before[0] - 1, before[1]),  # minus the result itself
        "merge (fresh result)": (lambda a, p: (a - 1, p))(*run(lse_ops.merge)),
        "merge_ (in place into the accumulator)": run(lse_ops.merge_),
    }


def _worker(rank: int, init_file: str, world: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=10))
    from hf_longctx.distributed.mesh import init_sequence_parallel

    rows = []
    meshes = {}
    for label, u, r, chunks, _, _ in LAYOUTS:
        if u * r != world:
            continue
        if (u, r) not in meshes:
            meshes[(u, r)] = init_sequence_parallel(u, r)
        rows.append((label, layout_costs(label, dataclasses.replace(meshes[(u, r)], fpdt_chunks=chunks))))
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def _run(world: int):
    from benchmarks._ranks import run_ranks

    return run_ranks(_worker, world, world)  # rank 0's rows


def table(rows: dict) -> list[str]:
    lines = [
        "Per decoder layer, one fwd+bwd step, rank 0, CUDA dispatch path (emulated flash-attn 2.8 kernel, stub offload streams)",
        "| layout | kernel-like ops | unpatched | ratio | target | collectives | host→device | device→host | syncs | "
        "syncs per step | saved for backward, B/token |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, *_, family in LAYOUTS:
        c = rows[label]
        plain = label in ("U2", "R2", "U2xR2")
        target = (f"≤ {TARGETS['ring' if 'R2' in label else 'ulysses']}×" if plain else "—")
        lines.append(
            f"| {label} | {c['kernels']:g} | {c['unpatched']:g} | {c['kernels'] / c['unpatched']:.2f}× | {target} | "
            f"{c['collectives']:g} | {c['h2d']:g} | {c['d2h']:g} | {c['syncs']:g} | {c['step']['syncs']:g} | "
            f"{'—' if c.get('saved') is None else format(c['saved'], 'g')} |"
        )
    for label, *_ in LAYOUTS:
        c = rows[label]
        if c["sync_sites"]:
            lines.append(f"  {label}: sync sites per layer {c['sync_sites']}")
        if c["step_sync_sites"]:
            lines.append(f"  {label}: sync sites per step {c['step_sync_sites']}")
    lines.append("Syncs per step: the SP group's batch-consistency check reads its gathered table on the host on CPU; "
                 "on CUDA it asserts on the device after the first micro-batch (torch._assert_async).")
    return lines


def main(argv: list[str]) -> None:
    """`--ops`: also print, per layout, the kernel-like aten ops per layer by name next to
    the unpatched model's (where the extra ops come from)."""
    rows = dict(_run(2) + _run(4))
    print("\n".join(table(rows)))
    print("\nOne ring step's merge of a bf16 block [1, 8, 4096, 128] into the float32 accumulator")
    print("| merge | [B, H, S, D] temporaries | [B, H, S, D] passes |")
    print("|---|---|---|")
    for name, (allocs, passes) in merge_costs().items():
        print(f"| {name} | {allocs} | {passes} |")
    if "--ops" in argv:
        for label, *_ in LAYOUTS:
            c = rows[label]
            names = sorted(set(c["kernel_names"]) | set(c["unpatched_names"]))
            diff = {n: c["kernel_names"].get(n, 0) - c["unpatched_names"].get(n, 0) for n in names}
            print(f"\n{label}: aten op per layer: patched - unpatched (patched)")
            print(", ".join(f"{n} {diff[n]:+g} ({c['kernel_names'].get(n, 0):g})" for n in names if diff[n]))


if __name__ == "__main__":
    main(sys.argv[1:])
