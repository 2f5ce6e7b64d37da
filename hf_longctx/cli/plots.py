"""`hf-longctx plan --plot FILE.png`: one sampled step planned for the suggested setting and
drawn per rank (`cli/load_plot.py`); with `--flex` planned with flexible SP groups and
compared with the suggestion's fixed degree.
"""

from __future__ import annotations

import argparse
from typing import Any


def plot_step(args: argparse.Namespace, config: Any, best) -> str:
    from hf_longctx.data.cost import CostModel
    from hf_longctx.layout import doc_multiple, seq_multiple
    from hf_longctx.data.packing import plan_microbatches
    from hf_longctx.cli import load_plot as plot

    s = best.setting
    cap = args.micro_batch_tokens
    if args.lengths_file:
        pool, source = plot.read_lengths(args.lengths_file), f"lengths from {args.lengths_file}"
    else:
        pool, source = plot.synthetic_lengths(cap, seed=args.seed), f"synthetic log-normal lengths (seed {args.seed})"
    lengths = plot.sample_step(pool, best.dp * cap * args.plot_microbatches, cap, seed=args.seed)
    cost = CostModel.from_config(config.get_text_config() if hasattr(config, "get_text_config") else config)
    dm = doc_multiple(s.ring)  # FPDT runs with ring 1, where this is 1
    plan = plan_microbatches(lengths, dp_size=best.dp, max_tokens=cap, cost=cost, doc_multiple=dm,
                             seq_multiple=seq_multiple(s.ring, s.ulysses, s.fpdt_chunks), overlong="split")
    title = (f"per-rank load of one sampled step: ulysses {s.ulysses} x ring {s.ring}, dp {best.dp}, "
             f"{cap} tokens per micro-batch\n{source}")
    stats = plot.draw_load(plan, cost, args.plot, title)
    return (f"wrote {args.plot}: one step of {len(lengths)} documents ({source}) planned for dp {best.dp}, "
            f"{plan.num_microbatches} micro-batches per rank; synchronised step / ideal = {stats['synced_over_ideal']:.3f}")


def plot_flexible_step(args: argparse.Namespace, config: Any, best) -> str:
    """The flexible plan of one sampled step at the best setting's tokens per rank, drawn
    per rank with each slot's group sizes; compared with that setting's fixed degree."""
    from hf_longctx.data.cost import GroupCost
    from hf_longctx.sp_groups import group_shapes
    from hf_longctx.flex.packing import plan_fixed, plan_flexible
    from hf_longctx.flex.unequal import plan_unequal
    from hf_longctx.data.model_dims import ModelDims
    from hf_longctx.flex.collator import layout_text
    from hf_longctx.cli import load_plot as plot

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    s, world = best.setting, args.gpus
    per_rank = args.micro_batch_tokens // s.sp  # the best fixed setting's tokens per rank
    shapes = group_shapes(world, heads=ModelDims.from_config(text).heads, max_size=world & -world,
                          ranks_per_node=min(args.gpus_per_node, world & -world))
    fixed_shape = next((sh for sh in shapes if sh.size == s.sp), None)
    from hf_longctx.capacity.cluster import Cluster

    gpu = Cluster(gpus=world, gpu_memory=args.gpu_memory, host_memory=args.host_memory, gpu=args.gpu,
                  intra_bw=args.intra_bw, inter_bw=args.inter_bw, pcie_bw=args.pcie_bw, latency=args.latency).gpu_spec
    cost = GroupCost.from_config(text, shapes, flops_per_s=gpu.gemm * gpu.bf16_flops, ulysses_bw=gpu.nvlink_bw * gpu.nccl,
                                 ring_bw=gpu.ib_bw * gpu.nccl)
    max_len = (fixed_shape or shapes[-1]).capacity(per_rank)  # documents the fixed setting can hold too
    if args.lengths_file:
        pool, source = plot.read_lengths(args.lengths_file), f"lengths from {args.lengths_file}"
    else:
        pool, source = plot.synthetic_lengths(max_len, seed=args.seed), f"synthetic log-normal lengths (seed {args.seed})"
    lengths = plot.sample_step(pool, world * per_rank * args.plot_microbatches, max_len, seed=args.seed)
    if args.unequal_calls:
        flex = plan_unequal(lengths, shapes=shapes, world_size=world, max_tokens_per_rank=per_rank, cost=cost)
        mode = "unequal micro-batch counts (makespan)"
    else:
        flex = plan_flexible(lengths, shapes=shapes, world_size=world, max_tokens_per_rank=per_rank, cost=cost,
                             num_slots=args.plot_microbatches)
        mode = "equal micro-batch counts (synchronised slots)"
    title = (f"flexible SP groups, one sampled step: {world} ranks, {per_rank} tokens per rank per micro-batch\n"
             f"{mode}; {source}")
    stats = plot.draw_flex_load(flex, cost, args.plot, title)
    out = (f"wrote {args.plot}: one step of {len(lengths)} documents ({source}) planned with flexible SP groups and "
           f"{mode} on {world} ranks, {per_rank} tokens per rank; slot layouts {layout_text(flex.layouts())}; "
           f"micro-batches per rank {stats['calls'][0]}-{stats['calls'][1]}; modelled step / "
           f"ideal = {stats['synced_over_ideal']:.3f}; per-rank busy max/mean = {stats['busy_max_over_mean']:.3f}")
    if fixed_shape is not None:
        fixed = plan_fixed(lengths, shape=fixed_shape, shapes=shapes, world_size=world, max_tokens_per_rank=per_rank,
                           cost=cost).stats(cost)
        out += (f"\nthe suggestion's fixed degree on the same step (sp {s.sp}, dp {world // s.sp}; split as the "
                f"bank's group of {s.sp}: ulysses {fixed_shape.ulysses} x ring {fixed_shape.ring}): synchronised step / ideal = {fixed['synced_over_ideal']:.3f}; "
                f"modelled speed-up of flexible groups {fixed['synced_step'] / stats['synced_step']:.2f}x")
    return out
