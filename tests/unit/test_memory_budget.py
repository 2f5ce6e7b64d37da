"""The per-token memory budget: the planner's terms against the census of a real step, and the
device peak of memory="max" growing with the chunk, not the sequence.

The census (`benchmarks/census.py`) records every storage a forward + backward allocates, by
name, with the CUDA offload branches running on CPU through emulated streams (host copies are
host memory, copies back new device tensors). The planner (`capacity/budget.step_budget`) writes
each of those tensors from the model's sizes; here its device peak and its host bytes must be
within 5 % of the census at three lengths and two model shapes (one process, bf16, one
document: the worst case the planner budgets). The local attention kernel's workspace is
counted apart by both (the CPU backend's is not flash-attn's).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.memory_budget import config, estimate, measure_lengths
from hf_longctx.distributed.mesh import init_sequence_parallel
from hf_longctx.capacity.estimate import ModelDims

LENGTHS = (1024, 2048, 4096)


def _planner(shape: str, mode: str, tokens: int) -> tuple[float, float]:
    return estimate(shape, mode, tokens, 1, 1)  # one process: the planner's device (kernel workspace apart) and host


@pytest.mark.parametrize("shape", ["T1", "T2"])
@pytest.mark.parametrize("mode", ["max u=4 offload", "max", "balanced"])
def test_planner_terms_agree_with_the_census(shape, mode):
    torch.manual_seed(0)
    mesh = init_sequence_parallel(1, 1)
    for tokens, got in zip(LENGTHS, measure_lengths(mesh, shape, mode, list(LENGTHS), warm_up=False)):
        device, host = _planner(shape, mode, tokens)
        assert abs(device / got["device"] - 1) <= 0.05, (tokens, device / got["s_local"], got["device"] / got["s_local"])
        if got["host"] or host:
            assert abs(host / got["host"] - 1) <= 0.05, (tokens, host, got["host"])


def test_max_peak_grows_with_the_chunk_not_the_sequence():
    """memory="max" with FPDT chunks: the sequence doubled with the chunk size fixed (twice the
    FPDT and MLP chunks) grows the device peak of a layer's backward by the sequence-long
    tensors only -- the layer input, the gradient through the layer, the next layer's prefetched
    input (three hidden-size vectors per token) and the rotary tables -- within 5 %; the chunk
    working set stays put. Everything the layer computes per token beyond those (q, k, v, the
    attention output, MLP activations, norm copies: tens of vectors per token without chunking)
    is O(chunk)."""
    from benchmarks import memory_budget as mb

    dims = ModelDims.from_config(config("T1"))
    mesh = init_sequence_parallel(1, 1)
    peaks = {}
    for tokens, chunks in ((4096, 4), (8192, 8)):  # u >= 4: FPDT's loop in its steady state at both
        mb.MODES["growth"] = (dict(checkpoint=True, kv_offload=True, mlp_chunks=2 * chunks, loss_chunks=64 * chunks // 4),
                              chunks)
        try:
            (got,) = measure_lengths(mesh, "T1", "growth", [tokens], warm_up=False)
        finally:
            del mb.MODES["growth"]
        layer = {k: d for k, (d, _) in got["phases"].items() if k.startswith("layer backward")}
        expected_phases = {label for label, _ in mb.PHASES if label.startswith("layer backward")}
        missing = expected_phases - {"layer backward: attention backward"} - set(layer)  # that one: without FPDT
        assert not missing, f"phases never seen (a renamed library function?): {missing}"
        peaks[tokens] = max(layer.values())
    v = 2 * dims.hidden  # bytes of one bf16 hidden-size vector
    rope = 2 * 2 * dims.head_dim  # cos and sin, bf16
    expected = (3 * v + rope) * 4096
    assert abs((peaks[8192] - peaks[4096]) / expected - 1) <= 0.05, (peaks, expected)


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2)], ids=["U2", "R2"])
def test_max_without_chunks_across_ranks(ulysses, ring):
    """memory="max" without FPDT chunks on 2 gloo ranks: the Ulysses all-to-all of q, k, v and of
    their gradients (head layout, send and receive buffers), and the ring's K/V and gradient
    buffers in flight, are in the planner's peak -- within 5 % of the worst rank's census."""
    import argparse

    from benchmarks._ranks import run_ranks
    from benchmarks.memory_budget import _worker

    args = argparse.Namespace(world=2, ring=ring, tokens=[4096], shapes=["T1"], modes=["max"])
    rows = run_ranks(_worker, 2, args)
    ((_, _, tokens, got),) = rows
    device, host = estimate("T1", "max", tokens, 2, ring)
    assert abs(device / got["device"] - 1) <= 0.05, (ulysses, ring, device / got["s_local"], got["device"] / got["s_local"])
    assert abs(host / got["host"] - 1) <= 0.05, (host, got["host"])
