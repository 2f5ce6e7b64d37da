"""The step-time model: seconds of one micro-batch of a setting on a `Cluster`.

Where it sits: `capacity/search.rank_settings` ranks settings by it (with the linear recurrences'
`capacity/mixers.py` and a vision tower's `capacity/vision.py` added). The micro-batch is
documents of `seq_len` tokens (one document: the worst case for attention). Compute is
`CostModel.from_config` FLOPs per SP rank at the cluster's MFU, plus what recompute and chunked
MLP run again; the Ulysses all-to-alls are exposed; ring P2P, FSDP collectives and host
offload count only beyond the compute they overlap; parameter offload adds PCIe traffic and a
CPU optimizer step. Every term: docs/DESIGN.md "The planner's models". Papers: USP §4 (all-to-all
and ring volume; ring P2P overlaps attention), FPDT §3-4 (chunks, host offload)."""

from __future__ import annotations

from hf_longctx.data.cost import CostModel
from hf_longctx.ops.ulysses import kv_replication
from hf_longctx.capacity.cluster import Cluster
from hf_longctx.capacity.estimate import DTYPE_BYTES, ModelDims, Setting, kept_attention_bytes


def keep_attention_bytes(dims: ModelDims, dt: int, keep: bool) -> float:
    """Bytes per token and layer keep_attention moves to the host and back: the attention's
    output and fp32 LSE (0 without it). With it the backward skips the attention's forward
    (its FLOPs and ring passes), the Ulysses all-to-alls still run three times."""
    return dt * dims.heads * dims.head_dim + 4 * dims.heads if keep else 0.0


def step_time(
    dims: ModelDims, cost: CostModel, s: Setting, cluster: Cluster, tokens: int, dtype: str, seq_len: int | None = None,
    *, microbatches: int = 1, optimizer: str = "adamw", grad_sync: str = "step",
) -> float:
    """Seconds of one micro-batch of `tokens` tokens made of documents of `seq_len`
    (default: one document of `tokens`), with its share of the step's CPU optimizer step
    when parameters are offloaded; see the module docstring for every term."""
    dt = DTYPE_BYTES[dtype]
    world = cluster.gpus
    rate = cluster.tflops * 1e12 * cluster.mfu
    seq_len = tokens if seq_len is None else seq_len
    docs, rest = divmod(tokens, seq_len)
    total = docs * cost(seq_len) + (cost(rest) if rest else 0.0)
    attn_compute = cost.a * (docs * seq_len**2 + rest**2) / s.sp / rate
    # Recompute: one more forward (1/3 of forward + backward); keep-attention skips its
    # attention part (the quadratic term of the cost model, `attn_flops`).
    attn_flops = cost.a * (docs * seq_len**2 + rest**2)
    keep = s.checkpoint is True and s.keep_attention  # row-chunked layers replay the kept output and LSE
    extra = total / 3 if s.checkpoint is True and not keep else (total - attn_flops) / 3 if s.checkpoint else 0.0
    if s.mlp_chunks > 1:
        extra += 2 * (3 if dims.gated else 2) * dims.hidden * dims.intermediate * dims.layers * tokens
    compute = (total + extra) / s.sp / rate

    f = kv_replication(dims.heads, dims.kv_heads, s.ulysses)
    q, kv = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim * f
    s_l = tokens / s.sp
    passes = 3 if s.checkpoint is True else 2  # forward, backward (+ recomputed forward; not with keep-attention)
    a2a = 0.0
    if s.ulysses > 1:
        volume = dims.layers * passes * dt * s_l * (2 * q + 2 * kv) * (s.ulysses - 1) / s.ulysses
        calls = dims.layers * passes * 4 * s.fpdt_chunks  # q, k, v, out per chunk
        a2a = volume / cluster.bandwidth(s.ulysses) + calls * cluster.latency
    ring = 0.0
    if s.ring > 1:
        block = dt * (tokens / s.ring) * 2 * kv / s.ulysses
        ring = dims.layers * (passes + 1 - keep) * (s.ring - 1) * block / cluster.bandwidth(s.sp)
    fsdp = 3 * dt * dims.params * (world - 1) / world / cluster.bandwidth(world) if world > 1 else 0.0
    offload = 0.0
    if s.kv_offload:
        # Every finished chunk goes to host once and comes back for the later query chunks
        # (causal: (u-1)/2 times on average) in forward and again in backward.
        offload += dims.layers * dt * s_l * (3 * q + 2 * kv) * (1 + s.fpdt_chunks) / cluster.pcie_bw
    if s.checkpoint:
        kept = kept_attention_bytes(dims, dt, f, s) if s.checkpoint == "attention" else keep_attention_bytes(dims, dt, keep)
        inputs = (dims.layers - min(dims.layers, s.inputs_on_device)) * dt * dims.hidden  # the rest stay on the GPU
        offload += 2 * s_l * (inputs + dims.layers * kept) / cluster.pcie_bw  # to host and back
    cpu_step = 0.0
    if s.param_offload:
        shard = 4 * dims.params / world  # fp32 bytes of this GPU's shard
        syncs = 1.0 if grad_sync == "microbatch" else 1.0 / microbatches  # gradient shards to host
        offload += (2 + syncs) * shard / cluster.pcie_bw
        cpu_step = (28 if optimizer == "adamw" else 12) / 4 * shard / cluster.cpu_optim_bw / microbatches
    return cpu_step + compute + a2a + max(0.0, ring - attn_compute) + max(0.0, fsdp - compute) + max(0.0, offload - compute)
