"""Pinned host buffers over steps of different lengths: registrations per step and bytes held.

Where it sits: a measurement of `ops/host_pool.HostPool` driven by the FPDT offload loops of
`ops/fpdt.py` (two layers per step, u = 2 chunks, every chunk offloaded through a
`ChunkStore`) on the CPU emulation of the CUDA streams (`benchmarks/census.EmulatedStreams`,
the real pool in plain memory). Nothing is timed. Three pools side by side in one run:

- "exact, unbounded": a free buffer serves its own size class only and nothing is released
  (the pool as a pool with no bound behaves);
- "bounded": the library's pool (a free buffer serves any request it holds; a miss releases
  free buffers first so the pool holds at most `high_water`, the most it ever lent at once);
- "bounded + prepare": the same, told each step's length first (`HostPool.prepare`, what the
  patch's pre-hook does), so a longer step's buffers are registered before it runs.

Per step: buffers registered during the step (cudaHostRegister calls on a GPU), released,
bytes held after it, the high-water mark, and the step's own peak on a fresh pool. A second
table runs the same comparison through `patch()` (memory presets, the pre-hook's `prepare`).

    PYTHONPATH=. python benchmarks/host_pool.py
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.census import EmulatedStreams  # noqa: E402
from hf_longctx.ops.fpdt import fpdt_backward, fpdt_forward, saved_keys  # noqa: E402
from hf_longctx.ops.fpdt_schedule import FPDTPlan  # noqa: E402
from hf_longctx.ops.host_pool import HostPool  # noqa: E402
from hf_longctx.ops.offload import ChunkStore  # noqa: E402

LENGTHS = (1024, 2048, 1536, 3072, 1024, 2048)  # tokens per step (one rank)
HEADS, HEAD_DIM, CHUNKS, LAYERS = 4, 32, 2, 2


class ExactPool(HostPool):
    """Exact size classes, never released, nothing registered ahead."""

    def _reuse(self, device, cls, nbytes=None):
        free = self._free.get((device, cls))
        return free.pop() if free else None

    def _trim(self, limit: int) -> None:
        pass

    def prepare(self, device, tokens: int) -> int:
        return 0


def step(streams: EmulatedStreams, s: int) -> None:
    """Forward of every layer, then backward in reverse, FPDT chunks offloaded to the pool."""
    kw = dict(scale=1 / math.sqrt(HEAD_DIM), causal=True, window=None, softcap=None)
    plan = FPDTPlan([0, s // 3, s], CHUNKS, group=None, causal=True, window=None, kw=kw)
    g = torch.Generator().manual_seed(s)
    keys, saved, outs = saved_keys(CHUNKS), [], []
    inputs = [[torch.randn(1, s, HEADS, HEAD_DIM, generator=g) for _ in range(4)] for _ in range(LAYERS)]
    for q, k, v, _ in inputs:
        store = ChunkStore("cpu", offload=True, streams=streams)
        outs.append(fpdt_forward(q, k, v, plan, store))
        saved.append((store.counts(keys), store.export(keys)))
    for layer in reversed(range(LAYERS)):
        q, k, v, dout = inputs[layer]
        store = ChunkStore("cpu", offload=True, streams=streams)
        store.load(keys, *saved.pop())
        fpdt_backward(dout, outs[layer], plan, store, q.shape, k.shape)


def rows() -> list[tuple]:
    own = {}
    for s in set(LENGTHS):
        fresh = EmulatedStreams()
        step(fresh, s)
        own[s] = fresh.pool.high_water
    out = []
    for label, pool_cls, prepare in (("exact, unbounded", ExactPool, False), ("bounded", HostPool, False),
                                     ("bounded + prepare", HostPool, True)):
        streams = EmulatedStreams()
        streams.pool = pool_cls(alloc=streams._alloc)
        for s in LENGTHS:
            if prepare:
                streams.pool.prepare("cpu", s)
            before = (streams.pool.allocations, streams.pool.releases)
            step(streams, s)
            pool = streams.pool
            out.append((label, s, pool.allocations - before[0], pool.releases - before[1],
                        pool.free_bytes() + pool.lent_bytes(), pool.high_water, own[s]))
    return out


PATCHED_LENGTHS = (128, 128, 64, 128, 256, 256, 200, 96, 256, 72)


def patched_row(memory: str, chunks: int, pool_cls) -> tuple:
    """A patched 3-layer Llama (hidden 64) on emulated CUDA offload, one micro-batch per length
    of PATCHED_LENGTHS: (registrations inside the layers per step, by the pre-hook per step,
    releases, bytes held at the end, high-water)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.census import emulated_offload
    from hf_longctx import init_sequence_parallel, patch, shard_batch

    streams = EmulatedStreams()
    pool = streams.pool = pool_cls(alloc=streams._alloc)
    prepared: list[int] = []
    prepare = pool.prepare
    pool.prepare = lambda device, tokens: prepared.append(prepare(device, tokens)) or prepared[-1]
    mesh = init_sequence_parallel(1, 1, fpdt_chunks=chunks)
    inside, ahead = [], []
    with emulated_offload(streams):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
        patch(model, mesh, memory=memory)
        model.train()
        for n in PATCHED_LENGTHS:
            before, k = pool.allocations, len(prepared)
            ids = torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n))
            model(**shard_batch({"input_ids": ids, "labels": ids.clone()}, mesh)).loss.backward()
            ahead.append(sum(prepared[k:]))
            inside.append(pool.allocations - before - ahead[-1])
    return inside, ahead, pool.releases, pool.free_bytes() + pool.lent_bytes(), pool.high_water


def main() -> None:
    print("| pool | tokens | registered in step | released | held after (B) | high-water (B) | step's own peak (B) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, s, reg, rel, held, hw, own in rows():
        print(f"| {label} | {s} | {reg} | {rel} | {held:,} | {hw:,} | {own:,} |")
    print(f"\nPatched 3-layer Llama, micro-batches of {', '.join(map(str, PATCHED_LENGTHS))} tokens:\n")
    print("| preset | pool | registered inside the layers, per step | by the pre-hook | released | held at the end (B) | high-water (B) |")
    print("|---|---|---|---|---:|---:|---:|")
    for memory, chunks in (("high", 2), ("max", 2), ("max", 4)):
        for label, pool_cls in (("exact, unbounded", ExactPool), ("bounded + prepare", HostPool)):
            inside, ahead, rel, held, hw = patched_row(memory, chunks, pool_cls)
            print(f"| memory={memory!r}, u={chunks} | {label} | {inside} | {ahead} | {rel} | {held:,} | {hw:,} |")


if __name__ == "__main__":
    main()
