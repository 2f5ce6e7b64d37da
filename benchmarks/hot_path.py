"""Hot-path costs per decoder layer on the CUDA dispatch path, counted on CPU (issue 19, item 2).

Where it sits: a measurement of the whole patched step (`integrations/transformers.patch`,
`ops/usp.py`, `ops/ring.py`, `ops/fpdt.py`, `ops/backends/packed.py`) with the local
attention forced onto the varlen (flash-attn 2.8 API) backend of `ops/backends/select.py`,
whose kernel is the CPU emulation of `tests/emulated_backends.py`. Nothing is timed: a
`TorchFunctionMode` and a `TorchDispatchMode` count what a GPU would pay per layer:

- kernel-like ops: aten ops on device tensors that are not views or allocations, plus one
  per (emulated) attention kernel call; the kernel's own internals are not counted;
- collectives: `c10d` ops (all-to-all, all-gather, send/recv, ...);
- host->device copies: a `.to(device)` of a tensor built on the host from Python data
  (`torch.tensor`, `torch.arange` ... with no `device=`), or `torch.tensor(data, device=)`;
- syncs: what would block the host on CUDA -- `aten._local_scalar_dense` (`.item()`,
  `int(t)`, `bool(t)`), `nonzero`, `is_nonzero`, `masked_select`, `unique`,
  `repeat_interleave` without `output_size`, `.tolist()` / `.cpu()` / `.numpy()` of a device
  tensor, and every host->device copy that is not `non_blocking=True`.

On CPU every tensor lives on the same device, so "host" is tracked by provenance: results
of factories called without `device=` and of ops whose tensor inputs are all host tensors
are host tensors; their ops are host work and not counted as kernels.

Per layer = (count of a 4-layer model - count of a 2-layer model) / 2, one fwd+bwd step,
rank 0, so per-step costs (sharding, loss, the consistency check) do not count. The
unpatched model (sdpa, the whole sequence on one process) gives the baseline ops per layer.

    PYTHONPATH=. python benchmarks/hot_path.py
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import sys
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (label, ulysses, ring, fpdt chunks, patch options, model family); world = ulysses x ring
LAYOUTS = [
    ("U2", 2, 1, 1, {}, "llama"),
    ("R2", 1, 2, 1, {}, "llama"),
    ("U2xR2", 2, 2, 1, {}, "llama"),
    ("FPDT u=2 (U2)", 2, 1, 2, {}, "llama"),
    ("memory='max' (U2, u=2)", 2, 1, 2, {"memory": "max"}, "llama"),
    ("hybrid LFM2 (U2)", 2, 1, 1, {}, "lfm2"),
    ("hybrid Qwen3.5 GDN state passing (U2xR2)", 2, 2, 1, {"mixers": "state"}, "qwen3_5"),
    ("hybrid Nemotron-H Mamba-2 state passing (U2xR2)", 2, 2, 1, {"mixers": "state"}, "nemotron_h"),
]
DOCS = [20, 12, 24, 8]  # one packed row of 64 tokens
TARGETS = {"ulysses": 1.25, "ring": 1.6}  # ops per layer / unpatched (issue 19)

FACTORIES = {
    torch.tensor, torch.as_tensor, torch.arange, torch.zeros, torch.ones, torch.full, torch.empty,
    torch.linspace, torch.from_numpy, torch.randperm, torch.eye,
}
SYNC_OPS = {"_local_scalar_dense", "nonzero", "is_nonzero", "masked_select", "_unique2", "unique_dim",
            "unique_consecutive", "equal", "nonzero_numpy", "argwhere"}
D2H_METHODS = {"tolist", "cpu", "numpy"}
NOT_KERNELS = {"detach", "empty", "empty_strided", "empty_like", "lift_fresh", "lift_fresh_copy", "set_", "resize_",
               "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset"}


class Counter:
    """Counts per category; `opaque()` hides a call's internals (counted as one kernel)."""

    def __init__(self):
        self.counts = {"kernels": 0, "collectives": 0, "h2d": 0, "syncs": 0}
        self.host: dict[int, weakref.ref] = {}  # id -> tensors built on the host
        self.host_depth = 0  # > 0 while a host-only call runs
        self.paused = 0
        self.sync_sites: list[str] = []
        self.kernel_names: collections.Counter = collections.Counter()  # aten name -> kernel-like calls

    def is_host(self, t) -> bool:
        ref = self.host.get(id(t)) if isinstance(t, torch.Tensor) else None
        return ref is not None and ref() is t

    def sync(self, what: str) -> None:
        self.counts["syncs"] += 1
        self.sync_sites.append(what)

    @contextlib.contextmanager
    def opaque(self):
        self.counts["kernels"] += 1
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


class _Functions(TorchFunctionMode):
    def __init__(self, counter: Counter):
        super().__init__()
        self.c = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.c
        if c.paused:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        host_in = bool(tensors) and all(c.is_host(t) for t in tensors)
        device_given = "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args[1:])
        if func in FACTORIES and kwargs.get("device") is not None and name in ("tensor", "as_tensor"):
            c.counts["h2d"] += 1
            c.sync(f"torch.{name}(data, device=)")  # a blocking copy of Python data
            return func(*args, **kwargs)
        if name in ("to", "cuda") and tensors and c.is_host(args[0]) and (device_given or name == "cuda"):
            c.counts["h2d"] += 1
            if not kwargs.get("non_blocking"):
                c.sync("blocking host->device .to()")
            return func(*args, **kwargs)  # a device tensor now
        if name in D2H_METHODS and tensors and not c.is_host(args[0]):
            c.sync(f"Tensor.{name}() of a device tensor")
        host = (func in FACTORIES and kwargs.get("device") is None) or host_in
        if host:
            c.host_depth += 1
        try:
            out = func(*args, **kwargs)
        finally:
            if host:
                c.host_depth -= 1
        if host:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    c.host[id(t)] = weakref.ref(t)
        return out


class _Aten(TorchDispatchMode):
    def __init__(self, counter: Counter):
        super().__init__()
        self.c = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.c
        if not c.paused and not c.host_depth:
            ns, name = func.namespace, func._schema.name.split("::")[-1]
            if ns in ("c10d", "_c10d_functional"):
                c.counts["collectives"] += 1
            elif name in SYNC_OPS or (name == "repeat_interleave" and kwargs.get("output_size") is None
                                      and isinstance(args[0], torch.Tensor) and len(args) < 2):
                c.sync(f"aten.{name}")
            elif not func.is_view and name not in NOT_KERNELS:
                c.counts["kernels"] += 1
                c.kernel_names[name] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting(counter: Counter):
    with _Functions(counter), _Aten(counter):
        yield


class CountedKernel:
    """A packed-kernel adapter whose calls count as one kernel each, internals hidden."""

    def __init__(self, kernel, counter: Counter):
        self.kernel, self.counter = kernel, counter

    def forward(self, *args, **kwargs):
        with self.counter.opaque():
            return self.kernel.forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        with self.counter.opaque():
            return self.kernel.backward(*args, **kwargs)


def model_config(family: str, layers: int):
    import transformers as tf

    small = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    if family == "lfm2":
        return tf.Lfm2Config(**small, layer_types=["conv", "full_attention"] * (layers // 2), conv_L_cache=3)
    if family == "qwen3_5":
        return tf.Qwen3_5TextConfig(**small, head_dim=16, layer_types=["linear_attention", "full_attention"] * (layers // 2),
                                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                    linear_value_head_dim=16, linear_conv_kernel_dim=4)
    if family == "nemotron_h":
        return tf.NemotronHConfig(**{k: v for k, v in small.items() if k != "num_hidden_layers"}, head_dim=16,
                                  layers_block_type=["mamba", "attention"] * (layers // 2), ssm_state_size=16,
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


def _step(model, kwargs, counter: Counter) -> dict:
    with counting(counter):
        model(**kwargs).loss.backward()
    return dict(counter.counts, sync_sites=list(counter.sync_sites), kernel_names=collections.Counter(counter.kernel_names))


@contextlib.contextmanager
def forced_cuda_path(counter: Counter):
    """Local attention on the packed flash-attn 2.8 backend with the emulated kernel."""
    from hf_longctx.ops import kernels
    from hf_longctx.ops.backends.packed import PackedBackend
    from tests.emulated_backends import cuda_env

    env, _ = cuda_env(flash="2.8.3", torch_ops=False)
    backend = PackedBackend("flash_attn", CountedKernel(env.flash_attn, counter))
    old = kernels.backend_for
    kernels.backend_for = lambda q, *, softcap, mask=False: backend
    try:
        yield
    finally:
        kernels.backend_for = old


def patched_counts(mesh, options: dict, family: str, layers: int) -> dict:
    """One fwd+bwd step of the patched model on this rank (collective: every rank calls it)."""
    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.integrations.transformers import patch

    model = _model(family, layers)
    patch(model, mesh, **options)
    model.train()
    shard = shard_batch(_batch(), mesh)
    counter = Counter()
    with forced_cuda_path(counter):
        model(**shard).loss.backward()  # warm-up: lazy initialisations out of the count
        model.zero_grad(set_to_none=True)
        return _step(model, shard, counter)


def unpatched_counts(family: str, layers: int) -> dict:
    model = _model(family, layers)
    model.train()
    return _step(model, _batch(), Counter())


def per_layer(lo: dict, hi: dict, span: int = 2) -> dict:
    return {k: (hi[k] - lo[k]) / span for k in ("kernels", "collectives", "h2d", "syncs")}


def layout_costs(label: str, mesh) -> dict:
    """Per-layer costs of one layout on this rank; `mesh` matches the layout's degrees."""
    _, _, _, _, options, family = next(row for row in LAYOUTS if row[0] == label)
    lo, hi = (patched_counts(mesh, options, family, n) for n in (2, 4))
    base_lo, base_hi = unpatched_counts(family, 2), unpatched_counts(family, 4)
    base = per_layer(base_lo, base_hi)
    out = per_layer(lo, hi)
    out["unpatched"] = base["kernels"]
    out["unpatched_names"] = {s: (n - base_lo["kernel_names"][s]) / 2 for s, n in base_hi["kernel_names"].items()}
    sites_lo, sites_hi = collections.Counter(lo["sync_sites"]), collections.Counter(hi["sync_sites"])
    out["sync_sites"] = {s: (n - sites_lo[s]) / 2 for s, n in sites_hi.items() if n != sites_lo[s]}  # per layer
    names_lo, names_hi = lo["kernel_names"], hi["kernel_names"]
    out["kernel_names"] = {s: (n - names_lo[s]) / 2 for s, n in names_hi.items() if n != names_lo[s]}  # per layer
    return out


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


def main(argv: list[str]) -> None:
    """`--ops`: also print, per layout, the kernel-like aten ops per layer by name next to
    the unpatched model's (where the extra ops come from)."""
    rows = dict(_run(2) + _run(4))
    print("Per decoder layer, one fwd+bwd step, rank 0, CUDA dispatch path with the emulated flash-attn 2.8 kernel")
    print("| layout | kernel-like ops | unpatched | ratio | target | collectives | host->device copies | syncs |")
    print("|---|---|---|---|---|---|---|---|")
    for label, *_ in LAYOUTS:
        c = rows[label]
        target = TARGETS["ring"] if "R2" in label else TARGETS["ulysses"]
        print(f"| {label} | {c['kernels']:g} | {c['unpatched']:g} | {c['kernels'] / c['unpatched']:.2f}x | "
              f"<= {target}x | {c['collectives']:g} | {c['h2d']:g} | {c['syncs']:g} |")
        if c["syncs"]:
            print(f"  sync sites: {c['sync_sites']}")
    if "--ops" in argv:
        for label, *_ in LAYOUTS:
            c = rows[label]
            names = sorted(set(c["kernel_names"]) | set(c["unpatched_names"]))
            diff = {n: c["kernel_names"].get(n, 0) - c["unpatched_names"].get(n, 0) for n in names}
            print(f"\n{label}: aten op per layer: patched - unpatched (patched)")
            print(", ".join(f"{n} {diff[n]:+g} ({c['kernel_names'].get(n, 0):g})" for n in names if diff[n]))


if __name__ == "__main__":
    main(sys.argv[1:])
