"""Kernels a step launches on CPU, compiled ones included: aten ops and inductor's generated kernels.

Where it sits: the instrument of `benchmarks/fused.py` and tests/distributed/test_fused.py.
`benchmarks/_counting.py` counts through a TorchDispatchMode, under which torch.compile runs
nothing compiled (dynamo leaves a frame eager while a dispatch mode is active), so it cannot
see the fused regions of `patch(fused=True)`. Here the step runs under torch.profiler with
inductor's per-kernel records on (`torch._inductor.config.cpp.enable_kernel_profile`, set
while the regions compile), and a launch is either a generated kernel (a record inside a
compiled graph's call) or an aten op that is neither composite (linear: t + mm) nor a view, an
alias or an allocation, counted once with whatever it calls inside (as a TorchDispatchMode
sees ops). One rule counts the eager and the fused step
alike, host-side aten work included (the same in both).
"""

from __future__ import annotations

import collections
import contextlib

import torch

from benchmarks._counting import NOT_KERNELS

GRAPH_CALL = "## Call CompiledFxGraph"  # inductor's record around one compiled graph's run


ALIASES = {"_unsafe_view", "alias", "_reshape_alias", "result_type"}  # no kernel on any device


def _main(name: str):
    """The overload a tensor op's record stands for: `.Tensor`, else `.default`, else the first."""
    packet = getattr(torch.ops.aten, name, None)
    names = [] if packet is None else packet.overloads()
    pick = next((o for o in ("Tensor", "default") if o in names), names[0] if names else None)
    return None if pick is None else getattr(packet, pick)


def _no_kernel(name: str) -> bool:
    """A view, alias or allocation: no kernel of its own."""
    op = _main(name)
    return name in NOT_KERNELS or name in ALIASES or op is not None and op.is_view


def _composite(name: str) -> bool:
    """An op that decomposes into others (linear -> t + mm): its kernels are its children."""
    op = _main(name)
    if op is None:
        return False
    try:  # a kernel of its own (silu_backward has both) wins over the decomposition
        has = lambda key: torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key)  # noqa: E731
        return has("CompositeImplicitAutograd") and not has("CPU")
    except RuntimeError:  # an overload the dispatcher does not know (a Python scalar op)
        return False


def launches(events) -> collections.Counter:
    """Launches by name among profiler `events` (see the module docstring): from each root
    record down, an aten op that is neither composite nor kernel-free counts once (what it
    calls inside is its kernel's business, as a TorchDispatchMode sees it); a generated kernel
    counts once, named `inductor:<its name>`."""
    out: collections.Counter = collections.Counter()

    def visit(e) -> None:
        if e.name.startswith("aten::"):
            name = e.name[len("aten::"):]
            if not _composite(name):  # `to` decomposes to `_to_copy` or nothing, though it may alias
                if not _no_kernel(name):
                    out[name] += 1
                return
        elif e.cpu_parent is not None and e.cpu_parent.name.startswith(GRAPH_CALL):
            out[f"inductor:{e.name}"] += 1
            return
        for child in e.cpu_children:
            visit(child)

    for e in events:
        if e.cpu_parent is None:
            visit(e)
    return out


@contextlib.contextmanager
def kernel_records():
    """Inductor config for the compiles inside: each generated CPU kernel records itself."""
    import torch._inductor.config as inductor

    with inductor.patch({"cpp.enable_kernel_profile": True}):
        yield


def step_launches(step) -> collections.Counter:
    """Launches of one call of `step()` (after the caller's warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return launches(prof.events())
