"""The step-time model's inventory (capacity/inventory.py) against the op stream a real patched
step records on the CUDA dispatch path (benchmarks/_op_stream.py), and its roofline's contract.

The recording runs the patched tiny Llama forward + backward through the autograd engine (the
emulated flash-attn 2.8 kernel, offload on its CUDA branch with stub streams) as rank 0 of a
one-rank fake process group. Equality is exact per kind of op: launches, FLOPs, HBM bytes,
link and PCIe bytes. A hot-path change the inventory does not follow fails here (dropping
the copy of a row chunk's input gradient into the layer's buffer, `dh[:, rows] = g`, from the
inventory's memory='max' fails the max case)."""

from __future__ import annotations

import dataclasses

import pytest

from hf_longctx.capacity.inventory import Shape, step_inventory
from hf_longctx.capacity.op_cost import Tally, attention_pairs

DIMS = dict(hidden=48, intermediate=80, heads=4, kv_heads=2, head_dim=8, vocab=112)
CASES = [  # (patch options, the inventory's knobs, tokens, layers)
    ({}, {}, 40, 2),
    ({"mlp_chunks": 3, "loss_chunks": 3}, {"mlp_chunks": 3, "loss_chunk": 14}, 40, 2),
    ({"mlp_chunks": 3, "loss_chunks": 3, "checkpoint": "attention"},
     {"mlp_chunks": 3, "loss_chunk": 14, "checkpoint": "attention"}, 40, 2),
    ({"mlp_chunks": 3, "loss_chunks": 3, "checkpoint": True}, {"mlp_chunks": 3, "loss_chunk": 14, "checkpoint": True}, 40, 2),
    ({"mlp_chunks": 2, "loss_chunks": 4, "checkpoint": True}, {"mlp_chunks": 2, "loss_chunk": 14, "checkpoint": True}, 56, 1),
    ({"mlp_chunks": 3, "loss_chunks": 3, "checkpoint": True, "keep_attention": True},
     {"mlp_chunks": 3, "loss_chunk": 14, "checkpoint": True, "keep_attention": True}, 40, 2),
]


@pytest.fixture(scope="module")
def mesh():
    import torch.distributed as dist

    from benchmarks._op_stream import fake_world
    from hf_longctx.distributed.mesh import init_sequence_parallel

    if dist.is_initialized():
        pytest.fail("a default process group is already up in this process; the recording needs its own fake one")
    with fake_world(1):
        yield dataclasses.replace(init_sequence_parallel(1, 1), fpdt_chunks=1)


@pytest.mark.parametrize("options,knobs,tokens,layers", CASES, ids=["off", "balanced", "high", "max", "max-56", "max-keep"])
def test_inventory_equals_recorded_stream(mesh, options, knobs, tokens, layers):
    from benchmarks._op_stream import llama, record

    recorded = Tally.of(record(llama(layers=layers, **DIMS), mesh, options, tokens)).as_dict()
    modelled = Tally.of(step_inventory(Shape(**DIMS, rows=tokens, **knobs), layers)).as_dict()
    assert recorded.keys() == modelled.keys()
    for k in recorded:
        assert modelled[k] == pytest.approx(recorded[k], rel=1e-12, abs=1e-9), k


def test_attention_pairs_against_a_dense_count():
    for nq in range(7):
        for nk in range(7):
            for causal, left, right in ((True, -1, -1), (False, 2, 1), (False, -1, 3), (True, 1, -1)):
                r = 0 if causal else right
                dense = sum(1 for i in range(nq) for j in range(nk)
                            if (r < 0 or j <= i + nk - nq + r) and (left < 0 or j >= i + nk - nq - left))
                assert attention_pairs(nq, nk, causal, left, right) == dense


def test_breakdown_sums_and_names_what_binds():
    from hf_longctx.capacity.cluster import Cluster
    from hf_longctx.capacity.estimate import ModelDims
    from hf_longctx.capacity.search import preset_setting
    from hf_longctx.capacity.step_time import step_time
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256)
    dims = ModelDims.from_config(cfg)
    cluster = Cluster(gpus=1, gpu_memory=141e9, host_memory=2e12, gpu="h200")
    short = step_time(dims, preset_setting(1, 1, 1, "off", dims), cluster, 1 << 15)
    long = step_time(dims, preset_setting(1, 1, 1, "off", dims), cluster, 1 << 17)
    assert short.seconds == pytest.approx(short.flops + short.hbm + short.launches + sum(short.links.values()))
    assert 0 < short.mfu < 1 and short.binds == "GEMMs"
    assert long.binds == "attention kernels"  # 128K: attention is most of the compute-bound time
    # attention's share grows with length, and its kernels run at about a third of peak against the GEMMs' 0.69
    assert long.mfu < short.mfu and long.attention / long.flops > short.attention / short.flops
    h100 = step_time(dims, preset_setting(1, 1, 1, "max", dims), dataclasses.replace(cluster, gpu="h100"), 1 << 15)
    h200 = step_time(dims, preset_setting(1, 1, 1, "max", dims), cluster, 1 << 15)
    assert h100.hbm > h200.hbm and h100.seconds > h200.seconds  # slower HBM
    # The same compute die: every op's FLOP time is the same on both; the H100's compute-bound
    # total lacks exactly the ops its slower HBM makes memory-bound (near the ridge: the K/V
    # projections' weight-gradient GEMMs into their fp32 sums).
    from hf_longctx.capacity.inventory import layer_ops, step_ops
    from hf_longctx.capacity.roofline import _compute
    from hf_longctx.capacity.step_time import shape_of

    shape = shape_of(dims, preset_setting(1, 1, 1, "max", dims), 1 << 15)
    g100, g200 = h100.gpu, h200.gpu
    flipped = [(op, k) for ops, k in ((step_ops(shape), 1), (layer_ops(shape), dims.layers)) for op in ops
               if _compute(op, g200, dims.head_dim)[0] > 0 and _compute(op, g100, dims.head_dim)[0] == 0]
    assert h100.flops + sum(k * op.count * _compute(op, g200, dims.head_dim)[0] for op, k in flipped) == pytest.approx(h200.flops)


def test_a_fetch_hides_only_under_the_compute_after_it():
    """`roofline.seconds`: a host-to-device copy is read by the next stretch, so only the compute
    issued after it hides it; device-to-host copies need only keep pace with the stretch."""
    from hf_longctx.capacity.gpus import GPUS
    from hf_longctx.capacity.op_cost import D2H, GEMM, H2D, Op
    from hf_longctx.capacity.roofline import Links, seconds

    gpu = GPUS["h200"]
    gemm = Op(GEMM, flops=gpu.gemm * gpu.bf16_flops * 1e-3)  # 1 ms
    copy = 2e-3 * gpu.pcie_h2d  # 2 ms of PCIe
    early = seconds([Op(H2D, bytes=copy, stream="side"), gemm, gemm, gemm], gpu, Links(), 128)
    late = seconds([gemm, gemm, Op(H2D, bytes=copy, stream="side"), gemm], gpu, Links(), 128)
    assert early.links.get("pcie", 0.0) == 0.0
    assert late.links["pcie"] == pytest.approx(2e-3 - (1e-3 + gpu.launch_s), rel=1e-9)  # one GEMM after it
    out = seconds([gemm, gemm, Op(D2H, bytes=2e-3 * gpu.pcie_d2h, stream="side"), gemm], gpu, Links(), 128)
    assert out.links.get("pcie", 0.0) == 0.0


def test_memory_max_fetches_the_next_input_after_the_attention_backward():
    """`integrations/layer_run.py` fetches the next layer's input after this layer's attention
    backward (under FPDT at the start of the backward); the inventory issues it there."""
    from hf_longctx.capacity.inventory import layer_ops
    from hf_longctx.capacity.op_cost import ATTN_BWD, H2D

    shape = Shape(**DIMS, rows=40, mlp_chunks=3, loss_chunk=14, checkpoint=True)
    ops = layer_ops(shape)
    fetch = [i for i, op in enumerate(ops) if op.kind == H2D]
    attention = [i for i, op in enumerate(ops) if op.kind == ATTN_BWD]
    assert fetch and min(fetch) > max(attention)
    ops = layer_ops(dataclasses.replace(shape, rows=20, ulysses=2, fpdt_chunks=2))
    fetch = [i for i, op in enumerate(ops) if op.kind == H2D and op.what != "kv offload"]
    assert fetch and max(fetch) < min(i for i, op in enumerate(ops) if op.kind == ATTN_BWD)
