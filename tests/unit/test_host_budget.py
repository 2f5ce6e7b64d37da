"""The host-memory check of offloading presets (`integrations/host_budget.py`): a micro-batch
whose pinned host memory would not fit this rank's share of the node is refused before any
offload, with both figures named."""

from __future__ import annotations

import pytest
import torch

from benchmarks.census import EmulatedStreams
from benchmarks.census import emulated_offload
from hf_longctx.integrations import host_budget
from hf_longctx.integrations.host_budget import HEADROOM, HostBudget
from hf_longctx.capacity.budget import step_budget
from hf_longctx.capacity.estimate import ModelDims, Setting

G = 2**30


def _llama_8b():
    from hf_longctx.cli.inputs import load_config

    return ModelDims.from_config(load_config("tests/data/llama-3.1-8b-config.json"))


def test_the_need_is_the_planners_host_budget_and_the_share_is_per_rank():
    """8B, Ulysses 8 with FPDT and memory="max" on a 2 TiB node with 8 ranks: 768K tokens per rank
    fit (the layer inputs, 192 GiB), 1.5M do not -- refused with both figures."""
    dims, s = _llama_8b(), Setting(8, 1, fpdt_chunks=4, kv_offload=True, checkpoint=True, mlp_chunks=14, loss_chunks=0)
    budget = HostBudget.for_patch(dims, s, sp=8, ranks_per_node=8, total=2048 * G)
    assert budget.capacity == pytest.approx(2048 * G * (1 - HEADROOM) / 8)
    need = budget.need(768 << 10)
    assert need == step_budget(dims, s, tokens=8 * (768 << 10)).host  # pool size classes included
    budget.check(768 << 10)
    with pytest.raises(ValueError, match=r"pins [0-9.]+ GiB of host memory per rank .* 8 rank\(s\) per node share 1843.2 GiB"):
        budget.check(3 << 19)


def test_patch_refuses_before_anything_is_offloaded(monkeypatch):
    """memory="max" with FPDT's offload on emulated CUDA streams, the node's memory set to 4 MiB:
    the first layer's pre-hook refuses the micro-batch; no pinned buffer was allocated."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_longctx import init_sequence_parallel, patch, shard_batch

    monkeypatch.setattr(host_budget, "node_memory", lambda: 4 << 20)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                         max_position_embeddings=1 << 16))
    mesh = init_sequence_parallel(1, 1, fpdt_chunks=2)
    streams = EmulatedStreams()
    ids = torch.randint(0, 128, (1, 1 << 14))
    with emulated_offload(streams):
        patch(model, mesh, memory="max")
        model.train()
        with pytest.raises(ValueError, match="host memory"):
            model(**shard_batch({"input_ids": ids, "labels": ids.clone()}, mesh))
        assert streams.pool.allocations == 0
        small = ids[:, :256]  # 256 tokens fit
        model(**shard_batch({"input_ids": small, "labels": small.clone()}, mesh)).loss.backward()
        assert streams.pool.allocations > 0


def test_whole_layer_checkpointing_pins_the_layer_inputs_only():
    """checkpoint=True without MLP chunks (whole-layer offloaded checkpointing) keeps each layer's
    input on the host and nothing of its attention; checkpoint="attention" adds the kept q, k, v,
    out, lse. 8B, one GPU, 256K tokens: 32 layers x 8 KiB x 256K = 64 GiB of inputs."""
    from hf_longctx.ops.host_pool import size_class

    dims, tokens = _llama_8b(), 256 << 10
    whole = step_budget(dims, Setting(1, 1, checkpoint=True), tokens=tokens).host
    assert whole == dims.layers * size_class(2 * dims.hidden * tokens) == 64 * G
    keep = step_budget(dims, Setting(1, 1, checkpoint="attention"), tokens=tokens).host
    assert keep > 3 * whole  # q, out and the token-layout output are hidden-sized each, k, v, lse besides


def test_patch_registers_a_longer_micro_batchs_buffers_before_its_layers():
    """memory="max" with FPDT's offload on emulated CUDA streams, micro-batches of 64, 128, 96
    and 128 tokens: the first registers its pinned buffers inside its layers (it sizes the
    pool); the longer second gets its own from the first layer's pre-hook
    (`offload.prepare_pinned`) before any layer runs; the others run in buffers the pool holds.
    Gradients equal those of the same steps without offload (every host copy is exact)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_longctx import init_sequence_parallel, patch, shard_batch

    mesh = init_sequence_parallel(1, 1, fpdt_chunks=2)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)
    batches = [torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in (64, 128, 96, 128)]

    def grads(streams):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        patch(model, mesh, memory="max")
        model.train()
        for ids in batches:
            before = (streams.pool.allocations, len(streams.prepared)) if streams is not None else None
            model(**shard_batch({"input_ids": ids, "labels": ids.clone()}, mesh)).loss.backward()
            if streams is not None:
                streams.inside.append(streams.pool.allocations - before[0] - sum(streams.prepared[before[1]:]))
        return [p.grad for p in model.parameters()]

    streams = EmulatedStreams()
    streams.inside, streams.prepared = [], []  # per micro-batch: registered in its layers / by the pre-hook
    prepare = streams.pool.prepare

    def counted_prepare(device, tokens):
        streams.prepared.append(prepare(device, tokens))
        return streams.prepared[-1]

    streams.pool.prepare = counted_prepare
    with emulated_offload(streams):
        got = grads(streams)
    assert streams.inside[0] > 0 and streams.inside[1:] == [0, 0, 0], streams.inside
    for a, b in zip(got, grads(None)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_planner_counts_host_memory_per_node():
    """`hf-longctx plan`: host memory is a node's, shared by its ranks -- a setting's host GiB per
    GPU times the GPUs of one node must fit --host-memory. 8B on 16 GPUs, 64K tokens, parameters,
    gradients and optimizer states offloaded (FSDP2 CPUOffloadPolicy): a node whose host holds 4.5
    ranks' share fits at 4 GPUs per node and not at 8 (the same per-GPU figure), and the reason
    names the per-node total."""
    from hf_longctx.capacity.search import Cluster, rank_settings
    from hf_longctx.cli.capacity import load_config

    config = load_config("tests/data/llama-3.1-8b-config.json")

    def offloading(gpus_per_node: int, host: float):
        cluster = Cluster(gpus=16, gpu_memory=80 * G, host_memory=host, gpus_per_node=gpus_per_node)
        ranked = rank_settings(config, cluster, 64 << 10, param_offload="yes")
        return next(c for c in ranked if (c.setting.ulysses, c.setting.ring, c.setting.fpdt_chunks) == (8, 1, 1)
                    and not c.setting.checkpoint and c.setting.param_offload)

    per_gpu = offloading(8, 2048 * G).memory.host
    host = 4.5 * per_gpu / (1 - HEADROOM)  # room for 4.5 ranks' host memory per node
    four, eight = offloading(4, host), offloading(8, host)
    assert per_gpu > 0 and four.memory.host == eight.memory.host == per_gpu
    assert four.host_fits and not eight.host_fits
    assert f"host {8 * per_gpu / G:.1f} > {host * (1 - HEADROOM) / G:.1f} GiB" in eight.reason
