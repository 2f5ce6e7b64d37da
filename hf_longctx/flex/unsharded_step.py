"""A training step with parameters unsharded from its first forward to its last backward, so
ranks may run different numbers of micro-batches (the unequal-count mode of flexible SP).

Where it sits: around the micro-batch loop of `flex/step.run_flex_step` and of the
trainer's step when the `FlexPlan` has `equal_calls=False` (Hydraulis §5). Every FSDP2 unit
is all-gathered ONCE at the start (same calls, same order on every rank), stays unsharded,
accumulates its gradient without communication, and reduce-scatters (SUM) in each rank's
own last backward; `FlexPlan.validate` makes that order agree with the groups' collectives.
Cost: the unsharded parameters and fp32 gradients for the whole step (`capacity/estimate`).
Refused before any collective: parameter CPU offload, and on CUDA a step that does not fit
some rank's free device memory. A model without FSDP needs nothing here."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from hf_longctx._compat import fsdp_param_groups
from hf_longctx.distributed.loss import collective_device


def fsdp_units(model: torch.nn.Module) -> list:
    """Every FSDP2 unit of `model` in module order (the same on every rank)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _param_groups(unit) -> list:
    """FSDP2's parameter groups of one unit (torch keeps no public accessor; empty for a
    unit without parameters of its own)."""
    return fsdp_param_groups(unit)


def unsharded_bytes(model: torch.nn.Module, gradients: bool = True) -> int:
    """Device bytes the step adds: every parameter unsharded in its param dtype (the dtype FSDP2
    gathers it in) plus, with `gradients` and for a trainable one, its unsharded gradient in the
    reduce dtype (fp32 unless FSDP's policy says otherwise). `gradients=False`: the gathered
    model alone (a rollout's weights, `generation/weights.py`)."""
    total = 0
    for unit in fsdp_units(model):
        groups = _param_groups(unit)
        if not groups:
            continue
        policy = groups[0].mp_policy  # torch's MixedPrecisionPolicy of this unit (one per fully_shard call)
        for p in _own_parameters(unit):
            numel = int(torch.Size(p.shape).numel())  # a DTensor parameter's shape is the global one
            pd = policy.param_dtype or p.dtype
            rd = policy.reduce_dtype or pd
            total += numel * (pd.itemsize + (rd.itemsize if gradients and p.requires_grad else 0))  # frozen: none
    return total


def _own_parameters(unit: torch.nn.Module) -> Iterator[torch.nn.Parameter]:
    """Parameters managed by this unit (not by a nested unit)."""
    from torch.distributed.fsdp import FSDPModule

    nested = {id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule) for p in m.parameters()}
    for p in unit.parameters():
        if id(p) not in nested:
            yield p


def check_unsharded_step(
    model: torch.nn.Module, group, *, free_bytes: Callable[[], int | None] | None = None
) -> None:
    """Refuse what the mode cannot run, on every rank together. `free_bytes`: this rank's free
    device memory (default: `torch.cuda.mem_get_info` on CUDA, no limit on CPU). The memory
    check is necessary, not sufficient: activations come on top (`hf-longctx plan
    --unequal-calls` estimates the whole peak)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    units = fsdp_units(model)
    offloaded = [type(u).__name__ for u in units if any(isinstance(pg.offload_policy, CPUOffloadPolicy)
                                                        for pg in _param_groups(u))]
    if offloaded:
        raise ValueError(
            f"unequal micro-batch counts keep every parameter unsharded on the device for the whole step, but "
            f"{len(offloaded)} FSDP unit(s) ({sorted(set(offloaded))[:4]}) offload parameters to the CPU (param_offload); "
            "use equal counts (plan_flexible) with offloading, or drop param_offload"
        )
    if not units:
        return
    if free_bytes is None:
        free_bytes = (lambda: torch.cuda.mem_get_info()[0]) if torch.cuda.is_available() else (lambda: None)
    need, free = unsharded_bytes(model), free_bytes()
    ok = free is None or need <= free
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        flag = torch.tensor([int(ok)], device=collective_device(group))  # [1]
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)  # [1]: 0 if any rank lacks the memory
        all_ok = bool(flag.item())
    else:
        all_ok = ok
    if not all_ok:
        where = f"this rank has {free / 2**30:.2f} GiB free" if not ok else "another rank lacks it"
        raise ValueError(
            f"unequal micro-batch counts need the unsharded parameters and gradients for the whole step: "
            f"{need / 2**30:.2f} GiB per rank, and {where}; plan with equal counts (plan_flexible) instead"
        )


@contextmanager
def unsharded_step(model: torch.nn.Module, num_microbatches: int) -> Iterator[Callable[[int], None]]:
    """`with unsharded_step(model, n) as before_backward:` call `before_backward(i)` before the
    backward of micro-batch i (0-based, n on this rank); the last one syncs and reshards.
    FSDP's per-unit reshard-after-forward settings are restored on exit."""
    units = fsdp_units(model)
    if num_microbatches < 1:
        raise ValueError(f"a rank runs at least one micro-batch per step, got {num_microbatches}")
    # FSDP2 keeps no public getter; its param group's post-forward mesh is set iff it reshards.
    saved = [any(pg.post_forward_mesh_info is not None for pg in _param_groups(u)) for u in units]
    for u in units:  # one all-gather per unit, in module order on every rank
        u.set_reshard_after_forward(False, recurse=False)
        u.set_reshard_after_backward(False, recurse=False)
        u.set_requires_gradient_sync(False, recurse=False)
        u.unshard()

    def before_backward(i: int) -> None:
        last = i == num_microbatches - 1
        for u in units:
            u.set_requires_gradient_sync(last, recurse=False)
            u.set_reshard_after_backward(last, recurse=False)

    try:
        yield before_backward
    finally:
        for u, reshard in zip(units, saved):
            u.set_reshard_after_forward(reshard, recurse=False)
            u.set_reshard_after_backward(True, recurse=False)
            u.set_requires_gradient_sync(True, recurse=False)
