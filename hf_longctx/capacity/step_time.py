"""The step-time model: seconds of one micro-batch of a setting on a `Cluster`, by what binds.

Where it sits: `capacity/search.rank_settings` ranks settings by `step_time(...).seconds`
(with the linear recurrences' `capacity/mixers.py` and a vision tower's `capacity/vision.py`
added); `hf-longctx plan` prints its MFU and what binds. One function from (model dims,
setting, cluster) to a `roofline.Breakdown`: the op inventory of the step on one GPU
(`capacity/inventory.py`, documents of `seq_len` tokens), FSDP's per-layer all-gathers and
reduce-scatter over the whole world, parameter offload's PCIe traffic and CPU optimizer step,
turned into seconds by `capacity/roofline.py` on the cluster's GPU (`capacity/gpus.py`).
No utilisation is assumed: MFU is an output. Papers: USP §4, FPDT §3-4; DESIGN "The
step-time model"."""

from __future__ import annotations

from hf_longctx.capacity.cluster import Cluster
from hf_longctx.capacity.estimate import DTYPE_BYTES, ModelDims, Setting
from hf_longctx.capacity.inventory import Shape, layer_ops, step_ops
from hf_longctx.capacity.mfu import strict_flops
from hf_longctx.capacity.op_cost import COLLECTIVE, Op
from hf_longctx.capacity.roofline import Breakdown, Links, seconds
from hf_longctx.capacity.budget_terms import loss_rows
from hf_longctx.ops.tiling import mlp_chunks_at


def shape_of(dims: ModelDims, s: Setting, tokens: int, seq_len: int | None = None) -> Shape:
    """The inventory's view of a setting: rows per rank, documents, and the chunk counts
    `patch()` resolves from the preset's "auto" knobs for those rows."""
    rows = tokens // s.sp
    seq_len = tokens if seq_len is None else seq_len
    docs, rest = divmod(tokens, seq_len)
    mlp = mlp_chunks_at(s.mlp_chunks, rows, auto=True) if s.mlp_chunks > 1 else 1
    loss = 0 if s.loss_chunks == 1 else loss_rows(dims, rows, s.loss_chunks, s.loss_chunk_rows)  # patch()'s rule
    return Shape(dims.hidden, dims.intermediate, dims.heads, dims.kv_heads, dims.head_dim, dims.vocab, rows,
                 docs=(seq_len,) * docs + ((rest,) if rest else ()), ulysses=s.ulysses, ring=s.ring,
                 fpdt_chunks=s.fpdt_chunks, checkpoint=s.checkpoint, kv_offload=s.kv_offload, mlp_chunks=mlp,
                 loss_chunk=loss, keep_attention=s.keep_attention and s.checkpoint is True, fused=s.fused)


class UntimedGPU(ValueError):
    """The cluster's GPU has no measured kernel fractions (`capacity/gpus.GPU.timed`)."""


def step_time(
    dims: ModelDims, s: Setting, cluster: Cluster, tokens: int, *, seq_len: int | None = None, dtype: str = "bf16",
    microbatches: int = 1, optimizer: str = "adamw", grad_sync: str = "step",
) -> Breakdown:
    """One micro-batch of `tokens` tokens per SP group (documents of `seq_len`, default one
    document) on one GPU of `cluster`, with its share of the step's CPU optimizer step when
    parameters are offloaded (see the module docstring). Raises `UntimedGPU` for a card
    without measured kernel fractions, rather than time it with another card's."""
    gpu, world = cluster.gpu_spec, cluster.gpus
    if not gpu.timed:
        raise UntimedGPU(gpu.untimed())
    shape = shape_of(dims, s, tokens, seq_len)
    links = Links({"ulysses": cluster.bandwidth(s.ulysses), "ring": cluster.bandwidth(s.sp),
                   "fsdp": cluster.bandwidth(world)})
    layer = layer_ops(shape)
    dt = DTYPE_BYTES[dtype]
    if world > 1:  # FSDP2: gather forward, gather backward, reduce-scatter; prefetched under the layer
        wire = dt * dims.layer_params * (world - 1) / world
        layer = layer + [Op(COLLECTIVE, bytes=2 * wire, link="fsdp", wire=wire, stream="side", count=3, what="fsdp")]
    out = Breakdown(gpu)
    out.add(seconds(step_ops(shape), gpu, links, dims.head_dim))
    out.add(seconds(layer, gpu, links, dims.head_dim), dims.layers)
    if s.param_offload:
        shard = 4 * dims.params / world  # fp32 bytes of this GPU's shard
        syncs = 1.0 if grad_sync == "microbatch" else 1.0 / microbatches
        pcie = (2 + syncs) * shard / min(gpu.pcie_h2d, gpu.pcie_d2h)
        out.links["pcie"] = out.links.get("pcie", 0.0) + max(0.0, pcie - (out.flops + out.hbm + out.launches))
        out.other["CPU optimizer"] = (28 if optimizer == "adamw" else 12) / 4 * shard / cluster.cpu_optim_bw / microbatches
    out.model_flops = strict_flops(dims, tokens, seq_len) / s.sp
    return out
