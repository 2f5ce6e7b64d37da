"""Loss and gradient reduction over the sequence-parallel world (DESIGN invariant 6).

Where it sits: after `model(**shard)`. Each rank's loss is already (sum of ITS token
losses) / num_items_in_batch, the valid-target count of the whole step. Therefore the
step's loss is the SUM of every rank's loss over every micro-batch (`global_loss`,
detached), and the single-device gradient is the SUM of the ranks' shares
(`sum_gradients`). Averaging (DDP's default) would divide it by the world size;
all-reducing the loss inside the graph would multiply it by the SP degree. The FSDP plan
sets its reduction to a sum for the same reason."""

from __future__ import annotations

from typing import Iterable, Literal

import torch


def collective_device(group, like: torch.Tensor | torch.device | None = None) -> torch.device:
    """The device a collective over `group` needs: the CUDA device this process set with
    `torch.cuda.set_device(LOCAL_RANK)` for NCCL (which refuses CPU tensors), CPU for gloo.
    A tensor (or device) `like` already on an accelerator keeps its device."""
    device = like.device if isinstance(like, torch.Tensor) else like
    if device is not None and torch.device(device).type != "cpu":
        return torch.device(device)
    if group is not None:
        import torch.distributed as dist

        if dist.get_backend(group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    if group is None:
        return t
    import torch.distributed as dist

    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)  # [] summed over the group
    return t


def global_loss(
    loss: torch.Tensor | float, mesh, *, dp_reduce: Literal["sum", "mean", "none"] = "sum"
) -> torch.Tensor:
    """The step loss for logging: detached, identical on every rank. A collective.

    Args:
        loss: This rank's loss (summed over its micro-batches if there are several).
        mesh (SPMesh): This rank's mesh.
        dp_reduce: `"sum"`: every rank normalised by the step's GLOBAL count (the
            collator's contract), so the step loss is the sum over SP and DP ranks.
            `"mean"`: each DP group normalised by its OWN count (a lone `shard_batch` per
            DP group with the default count): the SP sum is each group's loss; report their
            mean. `"none"`: only the SP sum (this DP group's loss).

    Returns:
        The step loss, a float64 scalar, the same on every rank.

    Raises:
        ValueError: An unknown `dp_reduce`.
    """
    if dp_reduce not in ("sum", "mean", "none"):
        raise ValueError(f"dp_reduce must be 'sum', 'mean' or 'none', got {dp_reduce!r}")
    t = torch.as_tensor(loss).detach()
    group = mesh.sp_group if mesh.sp_group is not None else mesh.dp_group
    t = t.to(collective_device(group, t), torch.float64, copy=True)  # []: float64, summing adds no rounding
    t = _all_reduce_sum(t, mesh.sp_group)  # []: this DP group's loss
    if dp_reduce != "none" and mesh.dp > 1:
        t = _all_reduce_sum(t, mesh.dp_group)  # []: summed over DP groups
        if dp_reduce == "mean":
            t = t / mesh.dp
    return t


def sum_gradients(parameters: Iterable[torch.nn.Parameter], mesh) -> None:
    """SUM every parameter gradient over all ranks (SP and DP), in place.

    For plain data/sequence parallel training without FSDP: afterwards every rank holds the
    single-device gradient of the global mean loss. A collective; every rank must call it
    with the same parameters in the same order.

    Every parameter that requires grad takes part, whether or not it got a gradient on this
    rank: an MoE expert that received no token of this rank's shard has `grad is None` here
    but a gradient on its peers, so skipping it would give the ranks buckets of different
    sizes (a gloo "collective mismatch", a hang or a wrong sum under NCCL). Such a parameter
    contributes zeros, and gets the summed gradient written back (or stays None when no rank
    had one: the all-reduced zeros are dropped, as the unsharded model would have no grad).
    Parameters that do not require grad never take part (the same on every rank).

    Args:
        parameters: The model's parameters, in the same order on every rank.
        mesh (SPMesh): This rank's mesh (the sum runs over its whole world).
    """
    if mesh.world_size == 1:
        return
    group = mesh.world_mesh.get_group()  # SP x DP = the whole world: one sum, not two
    params = [p for p in parameters if p.requires_grad]
    # Which parameters got a gradient on ANY rank: one tiny all-reduce (MAX) of P bytes per
    # call, on every rank (whether it misses a gradient or not), so the buckets agree.
    had = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8)  # [P]: 1 where this rank has a grad
    flags = had.to(collective_device(group, params[0].device if params else None))
    _all_reduce_max(flags, group)  # [P]: 1 where any rank has a grad
    grads = []
    for p, anywhere in zip(params, flags.tolist()):
        if not anywhere:
            continue  # no rank has a gradient: all skip it alike
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # this rank's share is zero (no token reached it)
        grads.append(p.grad)
    # Buckets of gradients of one dtype and device, ~64 MiB of fp32 each: one all-reduce per
    # bucket, not per tensor.
    bucket, size, limit = [], 0, 64 << 20
    for g in grads + [None]:
        if g is not None and bucket and (
            (g.dtype, g.device) != (bucket[0].dtype, bucket[0].device) or size + g.numel() * 4 > limit
        ):
            _flush(bucket, group)
            bucket, size = [], 0
        if g is None:
            _flush(bucket, group)
        else:
            bucket.append(g)
            size += g.numel() * 4


def _all_reduce_max(t: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # [P] elementwise max over the group
    return t


def _flush(bucket: list[torch.Tensor], group) -> None:
    """All-reduce one bucket. Low-precision (bf16) gradients are summed in fp32 and rounded
    once at the end, as FSDP's reduce_dtype=fp32 does: a ring all-reduce in bf16 would round
    every partial sum to 8 mantissa bits (world_size - 1 roundings)."""
    if not bucket:
        return
    acc = torch.float64 if bucket[0].dtype == torch.float64 else torch.float32
    flat = torch.cat([g.reshape(-1).to(acc) for g in bucket])  # [Σ numel] on the gradients' device
    _all_reduce_sum(flat, group)
    offset = 0
    for g in bucket:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
