"""Zero gradients for the parameters a rank did not use, for torch without FSDP2's switch.

Where it sits: `FSDPPlan.sum_reduction` (integrations/accelerate.py), on torch < 2.13 only
(`_compat.fsdp_reduces_unused_params()`). An MoE expert that got no token of this rank's
shard has no gradient here but one on its peers, and FSDP2 reduce-scatters only parameters
with a gradient, so the ranks' collectives would disagree. A forward hook on each FSDP unit
attaches an identity autograd function whose backward gives every managed parameter a zero
gradient: every rank reduce-scatters every parameter (one memset + one add per parameter,
no communication). Unlike torch 2.13's `set_reduce_scatter_unused_params(True)`, a
parameter NO rank used gets a zero gradient (not None), so weight decay still steps it."""

from __future__ import annotations

import torch


class _ZeroGrads(torch.autograd.Function):
    """Identity on `x`; backward gives each of `params` a zero gradient of its shape."""

    @staticmethod
    def forward(ctx, x, *params):
        ctx.metas = [(p.shape, p.dtype, p.device) for p in params]  # no tensor saved
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.metas))


def _own_parameters(unit: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Trainable parameters `unit` manages itself (not those of nested FSDP units)."""
    from torch.distributed.fsdp import FSDPModule

    nested = [m for m in unit.modules() if m is not unit and isinstance(m, FSDPModule)]
    skip = {id(p) for m in nested for p in m.parameters()}
    return [p for p in unit.parameters() if p.requires_grad and id(p) not in skip]


def _attach(module, args, output):
    params = _own_parameters(module)  # the unsharded parameters: this hook runs before FSDP reshards
    if not params or not torch.is_grad_enabled():
        return output
    if isinstance(output, torch.Tensor):
        return _ZeroGrads.apply(output, *params) if output.requires_grad else output
    if isinstance(output, dict):  # transformers ModelOutput
        for key, value in output.items():
            if isinstance(value, torch.Tensor) and value.requires_grad:
                output[key] = _ZeroGrads.apply(value, *params)
                break
        return output
    if isinstance(output, (tuple, list)):
        for i, value in enumerate(output):
            if isinstance(value, torch.Tensor) and value.requires_grad:
                return type(output)([*output[:i], _ZeroGrads.apply(value, *params), *output[i + 1:]])
        return output
    raise TypeError(f"{type(module).__name__} returned a {type(output).__name__}: cannot attach the zero gradients "
                    "torch < 2.13 needs for unused parameters (upgrade torch to 2.13 for FSDP2's own switch)")


def reduce_unused_params(unit: torch.nn.Module) -> None:
    """Every forward of FSDP `unit` makes each parameter it manages receive a gradient."""
    unit.register_forward_hook(_attach, prepend=True)  # before FSDP2's post-forward reshard
