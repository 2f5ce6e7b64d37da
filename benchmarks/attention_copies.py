"""Widened copies, zero fills and row gathers per attention call of ring and FPDT, counted on CPU.

Where it sits: a measurement of `ops/ring.py`, `ops/fpdt.py`, `ops/lse.py` and the packed
backend (`ops/backends/packed.py`) with the local attention forced onto the varlen
(flash-attn 2.8 API) backend whose kernel is the CPU emulation of
`tests/helpers/emulated_backends.py` -- the path a GPU runs. bf16 q/k/v, one forward and one
backward of `usp_attention` / `fpdt_attention` on each rank of 2 gloo ranks. A
`TorchDispatchMode` (`BlockOps`) sees every aten op outside the kernel and counts, for
tensors of at least half a K/V block ([H_kv, S/2, D] of the rank's stream):

- "widen": a bf16 tensor copied into a float32 one (`_to_copy`, `copy_`) -- the copies the
  merges need are the accumulators' starts (one per sum); every other one is waste;
- "zero fill": a float32 buffer filled with zeros (`zero_`, `fill_`) to add or merge into;
- "index": `index_select` / `index_add_` / `index_copy_` calls of any size (row gathers and
  scatters; a zigzag half of one document is one contiguous range: a view serves).

Bytes are the float32 bytes those copies and fills write, per token of the rank's shard.

    PYTHONPATH=. python benchmarks/attention_copies.py
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (label, ulysses, ring, fpdt chunks, document lengths); world = ulysses x ring = 2
LAYOUTS = [
    ("ring R=2, one document", 1, 2, 1, [256]),
    ("ring R=2, 4 packed documents", 1, 2, 1, [64, 96, 32, 64]),
    ("FPDT u=2 (U2), one document", 2, 1, 2, [256]),
    ("FPDT u=4 (U2), one document", 2, 1, 4, [256]),
    ("FPDT u=2 (U2), 4 packed documents", 2, 1, 2, [64, 96, 32, 64]),
]
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
LOW = (torch.bfloat16, torch.float16)


class BlockOps(TorchDispatchMode):
    """Counts widened copies and zero fills of at least `min_numel` elements and index ops;
    nothing while `paused` (the kernel's own computation)."""

    def __init__(self, min_numel: int):
        super().__init__()
        self.min_numel = min_numel
        self.counts: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()
        self.paused = 0

    def _note(self, what: str, t: torch.Tensor) -> None:
        self.counts[what] += 1
        self.bytes[what] += t.numel() * t.element_size()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        name = func._schema.name.split("::")[-1]
        if name in ("index_select", "index_add_", "index_copy_", "index_put_"):
            self.counts["index"] += 1
        big = lambda t: isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() >= self.min_numel  # noqa: E731
        if name == "_to_copy" and args[0].dtype in LOW and big(out):
            self._note("widen", out)
        elif name == "copy_" and args[1].dtype in LOW and big(args[0]):
            self._note("widen", args[0])
        elif name in ("zero_", "fill_") and big(args[0]) and not (name == "fill_" and float(args[1]) != 0.0):
            self._note("zero fill", args[0])
        elif name in ("zeros", "zeros_like", "new_zeros") and big(out):
            self._note("zero fill", out)
        return out


class _Paused:
    """A packed-kernel adapter whose internals the counter does not see."""

    def __init__(self, kernel, ops: BlockOps):
        self.kernel, self.ops = kernel, ops

    def forward(self, *args, **kwargs):
        self.ops.paused += 1
        try:
            return self.kernel.forward(*args, **kwargs)
        finally:
            self.ops.paused -= 1

    def backward(self, *args, **kwargs):
        self.ops.paused += 1
        try:
            return self.kernel.backward(*args, **kwargs)
        finally:
            self.ops.paused -= 1


@contextlib.contextmanager
def packed_backend(ops: BlockOps):
    """The local attention on the packed flash-attn 2.8 backend with the emulated kernel."""
    from hf_longctx.ops import kernels
    from hf_longctx.ops.backends.packed import PackedBackend
    from tests.helpers.emulated_backends import cuda_env

    env, _ = cuda_env(flash="2.8.3", torch_ops=False)
    backend = PackedBackend("flash_attn", _Paused(env.flash_attn, ops))
    old = kernels.backend_for
    kernels.backend_for = lambda q, *, softcap, mask=False, **_: backend
    try:
        yield
    finally:
        kernels.backend_for = old


def attention_ops(label: str, mesh) -> dict:
    """{"forward": counts, "backward": counts, "bytes per token": ...} of one attention call on this
    rank (collective: every rank of the layout's mesh calls it)."""
    from hf_longctx.ops.fpdt import fpdt_attention
    from hf_longctx.ops.usp import usp_attention

    _, _, _, _, docs = next(row for row in LAYOUTS if row[0] == label)
    cu = [0]
    for n in docs:
        cu.append(cu[-1] + n)
    s_local = cu[-1] // mesh.sp
    g = torch.Generator().manual_seed(mesh.sp_rank)
    q, k, v = (torch.randn(1, s_local, h, HEAD_DIM, generator=g).to(torch.bfloat16).requires_grad_()
               for h in (HEADS, KV_HEADS, KV_HEADS))
    dout = torch.randn(1, s_local, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    s_stream = cu[-1] // mesh.ring // (mesh.fpdt_chunks if mesh.fpdt_chunks > 1 else 1)
    heads_kv = max(1, KV_HEADS // mesh.ulysses)
    ops = BlockOps(min_numel=heads_kv * (s_stream // 2) * HEAD_DIM)
    result = {}
    with packed_backend(ops):
        fn = fpdt_attention if mesh.fpdt_chunks > 1 else usp_attention
        with ops:
            out = fn(q, k, v, mesh, cu_seqlens=cu)
        result["forward"], result["forward bytes"] = dict(ops.counts), dict(ops.bytes)
        ops.counts.clear(), ops.bytes.clear()
        with ops:
            out.backward(dout)
        result["backward"], result["backward bytes"] = dict(ops.counts), dict(ops.bytes)
    result["tokens"] = s_local
    return result


def _worker(rank: int, init_file: str, world: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=10))
    import dataclasses

    from hf_longctx.distributed.mesh import init_sequence_parallel

    rows, meshes = [], {}
    for label, u, r, chunks, _ in LAYOUTS:
        if (u, r) not in meshes:
            meshes[(u, r)] = init_sequence_parallel(u, r)
        rows.append((label, attention_ops(label, dataclasses.replace(meshes[(u, r)], fpdt_chunks=chunks))))
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def table(rows) -> list[str]:
    lines = [
        "Per attention call (= per layer), rank 0, bf16, packed flash-attn backend (emulated kernel); "
        "tensors >= half a K/V block",
        "| layout | pass | widened copies | zero fills | index ops | float32 bytes written by them per token |",
        "|---|---|---|---|---|---|",
    ]
    for label, r in rows:
        for phase in ("forward", "backward"):
            c, b = r[phase], r[f"{phase} bytes"]
            per_token = (b.get("widen", 0) + b.get("zero fill", 0)) / r["tokens"]
            lines.append(f"| {label} | {phase} | {c.get('widen', 0)} | {c.get('zero fill', 0)} | {c.get('index', 0)} | "
                         f"{per_token:g} |")
    return lines


def main() -> None:
    from benchmarks._ranks import run_ranks

    print("\n".join(table(run_ranks(_worker, 2, 2))))


if __name__ == "__main__":
    main()
