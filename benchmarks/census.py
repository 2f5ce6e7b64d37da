"""A census of tensor memory: every storage allocated inside it, by name, device vs host, and
what was alive at the device peak (MemTracker's bookkeeping, with names).

Where it sits: outside the library, under `benchmarks/memory_budget.py` and the tests of the
planner's per-token terms. `torch.distributed._tools.mem_tracker.MemTracker` reports bytes per
module and category; the per-token budget needs each tensor alive at the peak by name, so this
is the same mechanism (a `TorchDispatchMode` that records every fresh storage an op returns and
a weak reference that sees it die) with a name per storage:
- "[<module path>] <file:function> <aten op>": the module whose forward runs (also in a
  recompute), the innermost frame of the library or of a transformers model, the op;
- "grad <autograd node>" as the op when allocated by the autograd engine,
- the innermost `label(...)` the caller opened, when one is open.
Allocations of a local attention kernel that it frees before returning (`kernel()`: the
backend's workspace -- the CPU backend expands GQA heads and widens to fp32, flash-attn keeps
an fp32 dq accumulator) are counted apart (`kernel_peak`), not in the device total: the budget
is that of the library's tensors, the kernel's own is the backend's.
Storages that existed before the census (parameters, gradients allocated ahead, inputs) and
views of them are not counted: the figures are memory ABOVE the weights. Host memory: storages
the caller marks (`mark_host`: the emulated pinned buffers of `EmulatedStreams`) count as host,
everything else as device; on CPU this is what separates them.

`EmulatedStreams` is `ops/offload.Streams` on CPU with copies as on a GPU: pinned buffers from
a real `HostPool` (host memory, reused like on a GPU), a copy back to the "device" a new tensor,
events and streams inert. With it the offload branches (FPDT chunk stores, checkpointed inputs,
keep-attention) run on CPU exactly as on CUDA, and the census sees both sides of every copy.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hf_longctx.ops.host_pool import HostPool, plain_bytes


@dataclass
class Record:
    name: str
    nbytes: int
    host: bool = False
    kernel: bool = False  # allocated inside a local attention kernel call and not returned (yet)


@dataclass
class Snapshot:
    device: int = 0  # bytes alive on the device at the peak
    host: int = 0  # bytes alive on the host at the same moment
    by_name: dict = field(default_factory=dict)  # (name, host) -> bytes alive at the device peak


def frames_phase(table: list[tuple[str, str]]) -> Callable[[], str]:
    """A `phase_of` for `Census`: the first phase of `table` ((name, "file:function") pairs)
    whose function is on the Python stack, innermost frames first; "other" if none."""
    def phase() -> str:
        names = []
        frame = sys._getframe(2)
        while frame is not None:
            names.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}")
            frame = frame.f_back
        for name in names:
            for label, fn in table:
                if name == fn:
                    return label
        return "other"
    return phase


def _caller() -> str:
    """file:function of the innermost frame of the library or of a transformers model."""
    frame = sys._getframe(3)
    for _ in range(40):
        if frame is None:
            return ""
        path = frame.f_code.co_filename
        if ("hf_longctx" in path and "benchmarks" not in path) or "transformers/models" in path:
            return f"{os.path.basename(path)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return ""


class Census(TorchDispatchMode):
    """Counts fresh storages; `peak` is the snapshot at the highest device total; `host_peak`
    the highest host total."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, Record] = {}  # storage data_ptr -> record
        self._refs: dict[int, weakref.ref] = {}
        self.device = self.host = 0
        self.peak = Snapshot()
        self.host_peak = 0
        self._labels: list[str] = []
        self._modules: list[str] = []  # module paths whose forward is running
        self._handles: list = []
        self._kernel_depth = 0
        self.phases: dict[str, Snapshot] = {}  # phase -> snapshot at that phase's own peak
        self.phase_of: Callable[[], str] | None = None  # names the phase an allocation happens in
        self.kernel_now = self.kernel_peak = 0  # backend workspace of local attention kernels

    # ---- names ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def label(self, name: str):
        self._labels.append(name)
        try:
            yield
        finally:
            self._labels.pop()

    def name_modules(self, model: torch.nn.Module, prefix: str = "") -> None:
        """Name allocations by the module whose forward runs (forward and recompute), its path
        after `prefix` (e.g. "reference." for a second model)."""
        def pre(module, args, path):
            self._modules.append(path)

        def post(module, args, out):
            if self._modules:
                self._modules.pop()

        for path, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(lambda m, a, path=prefix + path: pre(m, a, path)))
            self._handles.append(module.register_forward_hook(post, always_call=True))  # also when forward raises

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @contextlib.contextmanager
    def kernel(self):
        """Around a local attention kernel call: what it allocates and frees before returning is
        its backend's workspace (counted apart: the CPU backend's differs from flash-attn's);
        what it returns joins the device total when it returns."""
        self._kernel_depth += 1
        try:
            yield
        finally:
            self._kernel_depth -= 1
            if not self._kernel_depth:
                for rec in self.live.values():
                    if rec.kernel:
                        rec.kernel = False
                        self.kernel_now -= rec.nbytes
                        self.device += rec.nbytes
                if self.device > self.peak.device:
                    self._snapshot()
                self._phase_peak()

    def _phase_peak(self) -> None:
        if self.phase_of is not None:
            phase = self.phase_of()
            if self.device > self.phases.get(phase, Snapshot()).device:
                self.phases[phase] = self._snap()

    def _name(self, func) -> str:
        if self._labels:
            return self._labels[-1]
        node = torch._C._current_autograd_node()
        where = self._modules[-1] if self._modules else ""
        code = _caller()
        op = f"grad {node.name()}" if node is not None else func.__name__.split(".")[0]
        return " ".join(x for x in (where and f"[{where}]", code, op) if x)

    # ---- bookkeeping ---------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        aliasing = any(r.alias_info is not None for r in func._schema.returns)
        if not aliasing:  # views and in-place ops return existing storages
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._add(t, func)
        return out

    def _add(self, t: torch.Tensor, func) -> None:
        if t.device.type == "meta":  # shapes only, no memory
            return
        st = t.untyped_storage()
        ptr, nbytes = st.data_ptr(), st.nbytes()
        if nbytes == 0 or ptr in self.live:
            return
        rec = self.live[ptr] = Record(self._name(func), nbytes, kernel=self._kernel_depth > 0)
        self._refs[ptr] = weakref.ref(st, lambda _, ptr=ptr: self._free(ptr))
        if rec.kernel:
            self.kernel_now += nbytes
            self.kernel_peak = max(self.kernel_peak, self.kernel_now)
            return
        self.device += nbytes
        if self.device > self.peak.device:
            self._snapshot()
        self._phase_peak()

    def _free(self, ptr: int) -> None:
        rec = self.live.pop(ptr, None)
        self._refs.pop(ptr, None)
        if rec is not None:
            if rec.host:
                self.host -= rec.nbytes
            elif rec.kernel:
                self.kernel_now -= rec.nbytes
            else:
                self.device -= rec.nbytes

    def mark_host(self, t: torch.Tensor, name: str) -> None:
        """The storage of `t` (allocated inside the census) is host memory."""
        rec = self.live.get(t.untyped_storage().data_ptr())
        if rec is None or rec.host or rec.kernel:
            return
        rec.host, rec.name = True, name
        self.device -= rec.nbytes
        self.host += rec.nbytes
        if self.host > self.host_peak:
            self.host_peak = self.host

    def _snap(self) -> Snapshot:
        by_name: dict = {}
        for rec in self.live.values():
            if not rec.kernel:
                by_name[rec.name, rec.host] = by_name.get((rec.name, rec.host), 0) + rec.nbytes
        return Snapshot(self.device, self.host, by_name)

    def _snapshot(self) -> None:
        self.peak = self._snap()



class EmulatedStreams:
    """`ops/offload.Streams` on CPU with real copies (see the module docstring)."""

    class _Inert:
        def wait_stream(self, other) -> None: ...
        def wait_event(self, event) -> None: ...
        def record(self, stream=None) -> None: ...
        def synchronize(self) -> None: ...
        def query(self) -> bool:
            return True

    def __init__(self, census: Census | None = None) -> None:
        self.census = census
        self.pool = HostPool(alloc=self._alloc)

    def _alloc(self, nbytes: int):
        mem = plain_bytes(nbytes)
        if self.census is not None:
            self.census.mark_host(mem.data, "pinned host buffers (pool)")
        return mem

    def offloads(self, device) -> bool:
        return True

    def is_host(self, tensor) -> bool:
        return self.pool.owns(tensor)

    def current(self, device):
        return self._Inert()

    def side(self, device, direction):
        return self._Inert()

    def on(self, stream):
        return contextlib.nullcontext()

    def event(self):
        return self._Inert()

    def pinned(self, like):
        return self.pool.take(like)[0]

    def to_device(self, host, device):
        if self.census is None:
            return host.clone()
        with self.census.label("device copies of host buffers (fetched / prefetched)"):
            return host.clone()

    def note(self, host, event, write) -> None:
        self.pool.note(host, event, write)

    def pending(self, host):
        return self.pool.pending(host)

    def recycle(self, host) -> None:
        self.pool.give(host)

    def keep_alive(self, tensor, stream) -> None: ...


@contextlib.contextmanager
def emulated_offload(streams):
    """Every offload of the library on `streams`: the modules that read `default_streams` (FPDT
    chunk stores, offloaded checkpoint inputs, kept attention, row-chunked layers)."""
    from hf_longctx.integrations import checkpointing, layer_split
    from hf_longctx.ops import offload

    saved = [(m, m.default_streams) for m in (offload, checkpointing, layer_split)]
    for m, _ in saved:
        m.default_streams = lambda: streams
    try:
        yield
    finally:
        for m, f in saved:
            m.default_streams = f
