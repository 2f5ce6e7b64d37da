"""memory="max" with keep_attention=True: the backward replays the kept attention output and LSE.

Each row-chunked layer keeps its attention's merged output and log-sum-exp (the ring's, or
every FPDT chunk's) with its parked input; the backward recomputes q, k, v (projections and
the forward all-to-all) but not the attention: the ring's / FPDT's backward runs from the kept
out and LSE (`ops/ring.RingReplay`, `ops/fpdt.fpdt_replay_chunks`). One training step gives the
loss and every gradient of memory="off" on Ulysses, ring, U×R, FPDT with and without K/V
offload (the CUDA offload branches emulated on CPU with real copies) and attention sinks with
an MoE (fp32: loss 1e-6, gradients 1e-5 relative, as tests/distributed/test_layer_split.py),
and the attention's forward kernel runs once per layer and step (twice without keeping).
The option is refused, naming the fix, where no row-chunked layer runs.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.layer_split_cases import _batch, _model, _step, assert_exact, errors_by_name
from tests.helpers.pool import worker_mesh

KNOBS = dict(checkpoint=True, mlp_chunks=4, loss_chunks="auto")


def _forward_kernels(model, mesh, batch, **options) -> int:
    """Attention forward kernel calls of the second step (`ops.kernels.varlen_forward`)."""
    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.integrations.model_patch import patch, unpatch
    from hf_longctx.ops import kernels

    patch(model, mesh, **options)
    model.train()
    shard = shard_batch(batch, mesh)
    model(**shard).loss.backward()
    original, calls = kernels.varlen_forward, [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    kernels.varlen_forward = counted
    try:
        model(**shard).loss.backward()
    finally:
        kernels.varlen_forward = original
    unpatch(model)
    return calls[0]


def _case(family: str, ulysses: int, ring: int, chunks: int, emulate: bool):
    mesh = worker_mesh(ulysses, ring, chunks)
    base = _model(family)
    batch = _batch(base.config.vocab_size)
    ref, _ = _step(copy.deepcopy(base), mesh, batch, memory="off")
    opts = dict(KNOBS, kv_offload=chunks > 1 and emulate, keep_attention=True)
    if emulate:
        from benchmarks.census import EmulatedStreams, emulated_offload

        with emulated_offload(EmulatedStreams()):
            got, runs = _step(copy.deepcopy(base), mesh, batch, **opts)
    else:
        got, runs = _step(copy.deepcopy(base), mesh, batch, **opts)
    errs = errors_by_name(base, got, ref)
    kernels = None
    if family == "llama" and not emulate:
        kernels = [_forward_kernels(copy.deepcopy(base), mesh, batch, **dict(KNOBS, keep_attention=keep))
                   for keep in (False, True)]
    return errs, runs, kernels


LAYOUTS = [  # (world, family, ulysses, ring, fpdt chunks, emulated offload copies)
    (2, "llama", 2, 1, 1, False),
    (2, "llama", 1, 2, 1, False),
    (4, "llama", 2, 2, 1, True),
    (2, "llama", 2, 1, 2, False),
    (2, "llama", 2, 1, 2, True),
    (2, "gpt_oss", 2, 1, 1, False),
    (2, "gpt_oss", 2, 1, 2, False),
]


@pytest.mark.parametrize("world,family,ulysses,ring,chunks,emulate", LAYOUTS,
                         ids=[f"{f}-u{u}r{r}c{c}{'-copies' if e else ''}" for _, f, u, r, c, e in LAYOUTS])
def test_keep_attention_under_max_equals_no_checkpointing(pools, world, family, ulysses, ring, chunks, emulate):
    for rank, (errs, runs, kernels) in enumerate(pools.get(world).run(_case, family, ulysses, ring, chunks, emulate)):
        assert runs == {"chunked": 2, "whole": 0}, runs
        assert_exact(errs, rank, family)
        if kernels is not None:  # per step, 2 layers: recomputed twice per layer, kept once
            recompute, kept = kernels
            assert kept * 2 == recompute and kept > 0, kernels


def test_keep_attention_needs_row_chunked_layers():
    from hf_longctx import init_sequence_parallel
    from hf_longctx.integrations.model_patch import patch

    mesh = init_sequence_parallel(1, 1)
    for options in (dict(memory="high"), dict(memory="balanced"), dict(checkpoint=True)):
        with pytest.raises(ValueError, match="keep_attention=True keeps the attention's output and log-sum-exp"):
            patch(_model("llama"), mesh, keep_attention=True, **options)
    with pytest.raises(ValueError, match="keep_attention must be True or False"):
        patch(_model("llama"), mesh, memory="max", keep_attention="yes")


# ---- bf16: the rule of tests/distributed/test_bf16.py (at most twice bf16's own error) ------------


def _bf16_cases(path: str, refs: dict, cases: list) -> dict:
    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.distributed.loss import global_loss, sum_gradients
    from hf_longctx.integrations.model_patch import patch
    from tests.helpers.bf16_rule import _docs, _flat, _fresh, _targets, excess

    out = {}
    for regime, (u, r, c) in cases:
        mesh = worker_mesh(u, r, c)
        model = patch(_fresh(path, torch.bfloat16 if regime == "bf16" else torch.float32), mesh, memory="max",
                      keep_attention=True)
        batch = _flat(_docs()[mesh.dp_rank :: mesh.dp])
        shard = shard_batch(batch, mesh, num_items_in_batch=_targets())
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=regime == "autocast"):
            loss = model(**shard).loss
        loss.backward()
        sum_gradients(model.parameters(), mesh)
        grads = {n: p.grad.double() for n, p in model.named_parameters()}
        truth, single = refs[regime]
        out[(regime, (u, r, c))] = excess(truth, single, (None, global_loss(loss, mesh, dp_reduce="none"), grads),
                                          mesh.dp_rank, mesh.dp)
    return out


def test_keep_attention_bf16_within_twice_bf16s_error(pools, tmp_path):
    from tests.helpers.bf16_rule import _check, references
    from tests.helpers.families import save_family

    path = save_family("llama", tmp_path)
    refs = references(path)
    cases = [(regime, layout) for regime in ("autocast", "bf16") for layout in ((2, 1, 1), (2, 1, 2))]
    _check(pools.get(2).run(_bf16_cases, path, {k: refs[k] for k in ("autocast", "bf16")}, cases, timeout=300))
