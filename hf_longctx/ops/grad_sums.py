"""Parameter gradients of row chunks, summed in place: one fp32 buffer per parameter per backward.

Where it sits: a row-chunked backward (`integrations/layer_run.py` for memory="max",
`ops/tiling._Tokenwise` for the chunked MLP and norms, `ops/chunked_loss.py` for the LM head)
opens one `GradSums` over the parameters it returns gradients for and binds it to the patch's
`SumsSlot`; the linear projections of the chunked region then run through `SinkLinear`, whose
backward adds the chunk's weight gradient straight into the parameter's sum with one GEMM
(`accumulate_mm_`): no full-size gradient per chunk, no separate add. Every other parameter
(norms, biases, sinks, a weight some other op also uses) is summed from its chunk gradient
(`GradSums.add`). The sums are fp32 (fp64 for fp64 parameters) and rounded to the parameter's
dtype once. FPDT §3.5 (chunked FFN and loss) with Megatron-style gradient accumulation fusion.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from hf_longctx._compat import gemm_accumulates_in_fp32


def accumulate_mm_(acc: Tensor, a: Tensor, b: Tensor, fresh: bool = False) -> None:
    """acc [M, N] += a [M, K] @ b [K, N] in place (`fresh`: acc = a @ b, its old values unread).

    Same dtype: one `addmm_`. Low-precision operands into an fp32 sum: on CUDA one tensor-core
    GEMM with the fp32 sum as its C (torch's `baddbmm(..., out_dtype=float32, out=acc)`, which
    scales and adds into `out` itself); elsewhere (CPU has no `out_dtype` kernel) the operands
    are widened K-block by K-block, the widened copies together at most a quarter of the sum's
    elements -- never a parameter-sized temporary."""
    beta = 0 if fresh else 1
    if a.dtype == acc.dtype and b.dtype == acc.dtype:
        acc.addmm_(a, b, beta=beta)
        return
    if gemm_accumulates_in_fp32(acc.device.type, a.dtype, acc.dtype):
        out = acc.unsqueeze(0)  # [1, M, N]: a view of the sum
        torch.baddbmm(out, a.unsqueeze(0), b.unsqueeze(0), beta=beta, out_dtype=acc.dtype, out=out)
        return
    step = max(1, acc.numel() // (4 * (a.shape[0] + b.shape[1])))  # rows of K per block
    for lo in range(0, a.shape[1], step):
        acc.addmm_(a[:, lo : lo + step].to(acc.dtype), b[lo : lo + step].to(acc.dtype), beta=beta if lo == 0 else 1)


def _sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The sum's dtype: float64 for float64 parameters (exact references), else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class GradSums:
    """The gradient sums of one backward over `params` (index = position in `params`)."""

    def __init__(self, params: list, needs: tuple | None = None) -> None:
        self.params = list(params)
        needs = (True,) * len(self.params) if needs is None else needs
        self.index = {id(p): i for i, (p, n) in enumerate(zip(self.params, needs)) if n}  # the sinks' parameters
        self.sums: dict[int, Tensor] = {}
        self.casts: dict[tuple, Tensor] = {}  # (index, dtype) -> the weight in the autocast dtype

    def _sum(self, i: int) -> tuple[Tensor, bool]:
        if i in self.sums:
            return self.sums[i], False
        p = self.params[i]
        acc = torch.empty(p.shape, dtype=_sum_dtype(p.dtype), device=p.device)
        self.sums[i] = acc
        return acc, True

    def add(self, i: int, grad: Tensor) -> None:
        """Add one chunk's gradient of parameter `i` (a parameter no projection sink covers)."""
        if i not in self.sums:
            self.sums[i] = grad.to(_sum_dtype(self.params[i].dtype), copy=True)
        else:
            self.sums[i].add_(grad)

    def addmm(self, i: int, a: Tensor, b: Tensor) -> None:
        """sums[i] += a @ b, the weight-gradient GEMM of one chunk writing into the sum."""
        acc, fresh = self._sum(i)
        accumulate_mm_(acc, a, b, fresh=fresh)

    def cast(self, i: int, weight: Tensor, dtype: torch.dtype) -> Tensor:
        """The weight in the autocast dtype, cast once per backward (autocast's own cache)."""
        key = (i, dtype)
        if key not in self.casts:
            self.casts[key] = weight.detach().to(dtype)
        return self.casts[key]

    def grads(self, rounded: bool = True) -> list[Tensor | None]:
        """Per parameter: its summed gradient in its own dtype (`rounded=False`: the fp32 sum
        itself; None: nothing reached it)."""
        out = [None if i not in self.sums else self.sums[i].to(p.dtype) if rounded else self.sums[i]
               for i, p in enumerate(self.params)]
        self.sums, self.casts = {}, {}
        return out


class SumsSlot:
    """Per patch: the `GradSums` the patched projections write into (None outside a chunked
    backward), and the projections whose outputs no backward reads while `unread` binds them."""

    def __init__(self) -> None:
        self.active: GradSums | None = None
        self.unread: frozenset = frozenset()  # ids of weights: their sink linear skips its forward GEMM
        self.poison: float | None = None  # fill those outputs with this value instead of leaving them uninitialised
        self.seen: set | None = None  # while recording: the ids of the weights a sink linear ran with

    @contextmanager
    def bound(self, sums: GradSums | None) -> Iterator[None]:
        previous, self.active = self.active, sums
        try:
            yield
        finally:
            self.active = previous

    @contextmanager
    def unread_outputs(self, ids: frozenset, poison: float | None = None, seen: set | None = None) -> Iterator[None]:
        """Inside: the sink linears of the weights `ids` return an uninitialised output (filled
        with `poison` when given) instead of running their forward GEMM; their backward is
        unchanged (it reads the input and the weight only). `seen` collects the ids of every
        weight a sink linear ran with."""
        previous = self.unread, self.poison, self.seen
        self.unread, self.poison, self.seen = ids, poison, seen
        try:
            yield
        finally:
            self.unread, self.poison, self.seen = previous

    def output(self, weight: Tensor) -> str | float:
        """How the sink linear of `weight` makes its output: "gemm", "empty", or a fill value."""
        if self.seen is not None:
            self.seen.add(id(weight))
        if id(weight) not in self.unread:
            return "gemm"
        return "empty" if self.poison is None else self.poison


class SinkLinear(torch.autograd.Function):
    """`F.linear(x, w, bias)` whose backward adds the weight gradient into `sums` (index `i`)
    instead of returning it; the input and bias gradients are returned as usual. `weight` is
    the parameter (its edge makes the engine run this backward; its gradient is None), `w` the
    tensor the GEMM uses (the parameter detached, or its autocast copy). `output`: "gemm" (the
    linear), or "empty" / a fill value -- an output of the right shape whose values nothing reads
    (`SumsSlot.unread_outputs`), no GEMM run; the backward is the same either way."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, sums: GradSums, i: int, w: Tensor,  # type: ignore[override]
                output: str | float = "gemm") -> Tensor:
        ctx.save_for_backward(x)
        ctx.w, ctx.sums, ctx.i = w, sums, i
        if output == "gemm":
            return F.linear(x, w, bias)
        shape = (*x.shape[:-1], w.shape[0])  # [..., out]
        return x.new_empty(shape) if output == "empty" else x.new_full(shape, output)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])  # [..., out] -> [N, out]
        ctx.sums.addmm(ctx.i, g2.t(), x.reshape(-1, x.shape[-1]))  # [out, N] @ [N, in] into [out, in]
        dx = grad.matmul(ctx.w) if ctx.needs_input_grad[0] else None  # [..., in], as aten's linear backward
        db = g2.sum(0) if ctx.needs_input_grad[2] else None  # [out]
        return dx, None, db, None, None, None, None


def sink_linear(x: Tensor, weight: Tensor, bias: Tensor | None, sums: GradSums, i: int,
                output: str | float = "gemm") -> Tensor:
    """`F.linear(x, weight, bias)` with the weight gradient summed into `sums`; under autocast
    the operands are cast as autocast casts them (the weight once per backward). `output`: as
    `SinkLinear`'s."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point():
        dtype = torch.get_autocast_dtype(device)
        x = x.to(dtype)  # [..., in]: the cast's backward returns dx in x's own dtype
        bias = None if bias is None else bias.to(dtype)
        return SinkLinear.apply(x, weight, bias, sums, i, sums.cast(i, weight, dtype), output)
    return SinkLinear.apply(x, weight, bias, sums, i, weight.detach(), output)


def routed_linear(module: torch.nn.Module, slot: SumsSlot):
    """A forward for the `nn.Linear` `module`: its own forward, except inside a chunked backward
    whose sums cover its weight (`slot.active`), where it runs `sink_linear`."""
    original = module.forward

    def forward(x: Tensor) -> Tensor:
        sums = slot.active
        if sums is not None and torch.is_grad_enabled():
            i = sums.index.get(id(module.weight))
            if i is not None:
                return sink_linear(x, module.weight, module.bias, sums, i, slot.output(module.weight))
        return original(x)

    return forward
