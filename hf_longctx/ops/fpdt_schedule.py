"""FPDT's chunk schedule for one micro-batch: which K/V chunks each query chunk attends to (FPDT paper §3.3, Figure 6).

Where it sits: `fpdt_attention` (`ops/fpdt.py`) and the row-chunked layers
(`integrations/layer_run.py`) call `plan_for` first, before any all-to-all: it checks the inputs
(shapes only) on every rank and returns the micro-batch's `FPDTPlan`, from the caller's
`plan_cache` when it keeps one, so every layer of a micro-batch shares one schedule.
Pure Python over the global document boundaries: the same schedule on every rank.
Guarantees: chunk i's runs are global segment i (`layout.fpdt_chunk_range`); `needs[i]` lists
exactly the K/V chunks holding a pair query chunk i may attend (causal, window, documents)."""

from __future__ import annotations

import math
from typing import Sequence

from hf_longctx.layout import Run, fpdt_chunk_range, runs_of_range
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.ops import blocks, kernels
from hf_longctx.ops.usp import check_inputs


class FPDTPlan:
    """The chunk schedule, identical on every rank: the runs of every global segment and,
    per query chunk, the K/V chunks holding an allowed pair."""

    def __init__(self, cu: Sequence[int], chunks: int, *, group, causal: bool, window: int | None, kw: dict,
                 choice=None):
        self.group, self.chunks, self.kw, self.choice = group, chunks, kw, choice
        total = cu[-1]
        self.runs: list[list[Run]] = [runs_of_range(cu, *fpdt_chunk_range(total, chunks, i)) for i in range(chunks)]
        # tiles[i][j]: the (query chunk i, K/V chunk j) tiles, planned once per micro-batch
        self.tiles: list[list[blocks.Tiles]] = [
            [blocks.Tiles(blocks.plan_blocks(self.runs[i], self.runs[j], causal=causal, window=window)) for j in range(chunks)]
            for i in range(chunks)
        ]
        self.needs: list[list[int]] = [[j for j in range(chunks) if self.tiles[i][j]] for i in range(chunks)]
        # A query chunk is computed at the step its last needed K/V chunk arrives (its own
        # step at the latest, so its q need not be stored for causal masks).
        self.ready_at = [max(need + [i]) for i, need in enumerate(self.needs)]
        # Backward: dq_i is complete after the outer step of the last K/V chunk it needs.
        self.dq_done_at = [max(need) if need else 0 for need in self.needs]
        self.users = [[i for i in range(chunks) if j in self.needs[i]] for j in range(chunks)]
        self.backends: dict = {}  # the local attention backend, chosen once per plan, i.e. per micro-batch

    def backend(self, q):
        """The local attention backend of this micro-batch's calls with queries like `q`
        (`kernels.batch_backend`: probed and checked on the first call only)."""
        return kernels.batch_backend(q, softcap=self.kw["softcap"], memo=self.backends, window=self.kw["window"],
                                     choice=self.choice)


def make_plan(mesh: SPMesh, cu: Sequence[int], *, scale: float, causal: bool, window, softcap, choice=None) -> FPDTPlan:
    kw = dict(scale=scale, causal=causal, window=window, softcap=softcap)
    return FPDTPlan(cu, mesh.fpdt_chunks, group=mesh.ulysses_group, causal=causal, window=window, kw=kw, choice=choice)


def plan_for(q, k, v, mesh: SPMesh, *, cu_seqlens, causal, softmax_scale, window, softcap, sinks, plan_cache,
             choice=None) -> FPDTPlan:
    """Check the inputs (q [B, S_local, H, D], k/v [B, S_local, H_kv, D]: shapes only, meta
    tensors do) on every rank before any collective, and return the chunk plan of this
    micro-batch -- from `plan_cache` when the caller keeps one (every layer shares it); with a
    real q, the plan's local attention backend is chosen here too (`choice`: `AttentionChoice`)."""
    if mesh.ring != 1:
        raise ValueError(f"fpdt_attention needs ring degree 1, got ring {mesh.ring} (fpdt_chunks {mesh.fpdt_chunks})")
    u = mesh.fpdt_chunks
    if q.dim() == 4 and (q.shape[1] == 0 or q.shape[1] % u):
        raise ValueError(
            f"S_local ({q.shape[1]}) must be a positive multiple of fpdt_chunks ({u}): every rank cuts its "
            f"tokens into {u} equal chunks (packed length = S_local x ulysses({mesh.ulysses}))"
        )
    cu, cu_key = check_inputs(q, k, v, mesh, cu_seqlens, window, softcap, sinks, plan_cache)
    if cu_seqlens is None:
        cu = [0, q.shape[1] * mesh.ulysses]  # the same single-document layout in every batch row
        cu_key = tuple(cu)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    # Every layer of a micro-batch has the same boundaries: one plan per batch (pure Python).
    key = ("fpdt", cu_key, u, id(mesh.ulysses_group), scale, causal, window, softcap, choice)
    plan = plan_cache.get(key) if plan_cache is not None else None
    if plan is None:
        plan = make_plan(mesh, cu, scale=scale, causal=causal, window=window, softcap=softcap, choice=choice)
        if plan_cache is not None:
            plan_cache[key] = plan
    if q.device.type != "meta":  # the kernel chosen (or refused) on every rank alike before any collective
        plan.backend(q)
    return plan
