"""What one training step would cost a GPU, counted on CPU: kernels, collectives, copies, host syncs.

Where it sits: the instrument of `benchmarks/hot_path.py` (and of its tests). On CPU every
tensor shares one device, so "on the GPU" is tracked by provenance, per STORAGE (views,
detached aliases and the tensors autograd unpacks for a backward share it):

- device: the model's parameters and buffers and the batch (`mark_device`), the result of a
  `.to(device)` / `.cuda()` of a host tensor (the "device copy": a distinct tensor here,
  even where CPU's `.to` would return its input), factories given a `device=`, and the
  result of every op with a device input -- including ops with no tensor input that run
  inside a device op or in the autograd engine (C++ allocations on the op's device);
- host: everything else -- tensors built from Python data or by factories without
  `device=`, at `patch()`, in a warm-up or cached, and the result of a `.cpu()` /
  `.to("cpu")` of a device tensor. Tracking runs from construction on; counting only inside
  `counter.counting()`.

Counted, per category: kernel-like aten ops on device tensors (not views or allocations; an
opaque kernel call counts one); collectives (`c10d` ops); host->device copies (`.to` of a
host tensor, `copy_` into a device tensor, `torch.tensor(data, device=)`); device->host
copies (`.cpu()`, `.to("cpu")`, `copy_` into a host tensor); and SYNCS -- what blocks the
host on CUDA: a value read of a device tensor (`.item()`, `bool()`, `int()` i.e.
`_local_scalar_dense` / `is_nonzero`, `.tolist()`, `.numpy()`), ops whose output size
depends on device data (`nonzero`, `masked_select`, `unique`, `repeat_interleave` without
`output_size`, `equal`), a copy in either direction that is not `non_blocking`, a host
tensor (dim > 0) read by a device op (an implicit pageable copy), and a stream or event
`synchronize()` of the stub streams (`benchmarks/_stubs.py`).

The backward runs through the autograd engine with the function mode still active: a
`TorchFunctionMode` is switched off while it handles a call, so handing it `loss.backward()`
would hide every Python-level read in custom backward functions.

Limit: a `.to(torch.device("cpu"))` of a device tensor reads as a same-device no-op (the
object cannot be told from the device's own here); `.cpu()`, `.to("cpu")` and `copy_` are seen.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

FACTORIES = {
    torch.tensor, torch.as_tensor, torch.asarray, torch.arange, torch.zeros, torch.ones, torch.full, torch.empty,
    torch.empty_strided, torch.linspace, torch.from_numpy, torch.randperm, torch.eye, torch.randn, torch.rand,
    torch.randint, torch.scalar_tensor,
}
SYNC_OPS = {"_local_scalar_dense", "nonzero", "is_nonzero", "masked_select", "_unique2", "unique_dim",
            "unique_consecutive", "equal", "nonzero_numpy", "argwhere", "nonzero_static"}
VALUE_READS = {"tolist", "numpy"}  # no aten op of their own; `.item()`, `bool()`, `int()` dispatch _local_scalar_dense
NOT_KERNELS = {"detach", "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "lift_fresh_copy", "set_", "resize_",
               "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset"}
_DEVICE_ATTR = torch._C.TensorBase.device


def _key(t: torch.Tensor):
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # no storage (e.g. a functional wrapper): by object
        return ("obj", id(t))


class Counter:
    """Provenance of every tensor (device or host) and the counts of the current step."""

    def __init__(self) -> None:
        self.counts = {"kernels": 0, "collectives": 0, "h2d": 0, "d2h": 0, "syncs": 0}
        self.sync_sites: list[str] = []
        self.kernel_names: collections.Counter = collections.Counter()
        self._device: dict[Any, Any] = {}  # storage key -> the storage (kept: its key is never reused)
        self._device_objects: dict[int, torch.device] = {}  # `.device` read from device tensors (kept alive)
        self._calls: list[bool] = []  # innermost Python-level call: True = host work
        self._counting = 0
        self._tracking = False
        self.paused = 0

    # ---- provenance --------------------------------------------------------------------
    def is_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and _key(t) in self._device

    def mark_device(self, *values) -> None:
        for t in tree_leaves(values):
            if isinstance(t, torch.Tensor):
                k = _key(t)
                if k not in self._device:
                    self._device[k] = t.untyped_storage() if not isinstance(k, tuple) else t

    def mark_module(self, module: torch.nn.Module) -> None:
        self.mark_device(list(module.parameters()), list(module.buffers()))

    def device_object(self, obj) -> bool:
        return id(obj) in self._device_objects and self._device_objects[id(obj)] is obj

    # ---- counts ------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self._counting > 0 and not self.paused

    def sync(self, what: str) -> None:
        if self.active:
            self.counts["syncs"] += 1
            self.sync_sites.append(what)

    def add(self, what: str, n: int = 1, op: tuple | None = None) -> None:
        """Count `n` of `what`; `op` = (func, args, kwargs, out) of the counted call goes to `record`."""
        if self.active:
            self.counts[what] += n
            if op is not None:
                self.record(what, *op)

    def record(self, what: str, func, args: tuple, kwargs: dict, out) -> None:
        """One counted call (a kernel, collective or copy) with its operands: nothing here; a
        subclass keeps the op stream (`benchmarks/_op_stream.py`). `func` is the aten op, or the
        name of the Python-level call (`to`, `cuda`, `cpu`) of a copy between host and device."""

    def snapshot(self) -> dict:
        return dict(self.counts, sync_sites=list(self.sync_sites), kernel_names=collections.Counter(self.kernel_names))

    def reset(self) -> None:
        self.counts = dict.fromkeys(self.counts, 0)
        self.sync_sites.clear()
        self.kernel_names.clear()

    @contextlib.contextmanager
    def tracking(self):
        """Provenance only (construction, patch(), warm-up); nested uses share one pair of modes."""
        if self._tracking:
            yield self
            return
        self._tracking = True
        try:
            with _Functions(self), _Aten(self):
                yield self
        finally:
            self._tracking = False

    @contextlib.contextmanager
    def counting(self):
        """Provenance and counts."""
        self._counting += 1
        try:
            with self.tracking():
                yield self
        finally:
            self._counting -= 1

    @contextlib.contextmanager
    def opaque(self):
        """One kernel call: counted as one kernel, internals hidden; its outputs are marked
        device by the caller (`CountedKernel`)."""
        self.add("kernels")
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    @contextlib.contextmanager
    def call(self, host: bool):
        self._calls.append(host)
        try:
            yield
        finally:
            self._calls.pop()

    def in_host_call(self) -> bool:
        return bool(self._calls) and self._calls[-1]


def _target(c: Counter, src: torch.Tensor, name: str, args: tuple, kwargs: dict) -> str | None:
    """'device' / 'host' / None (no device change) for a `.to` / `.cuda` / `.cpu` call on `src`."""
    if name == "cuda":
        return "device"
    if name == "cpu":
        return "host"
    dev = kwargs.get("device")
    if dev is None and len(args) > 1 and isinstance(args[1], (str, torch.device, int)):
        dev = args[1]
    if dev is None and len(args) > 1 and isinstance(args[1], torch.Tensor):  # .to(other)
        return "device" if c.is_device(args[1]) else "host"
    if dev is None:
        return None
    if isinstance(dev, (str, int)):
        return "host" if str(dev).startswith("cpu") else "device"
    if c.device_object(dev) or dev.type != "cpu":
        return "device"
    return "device" if not c.is_device(src) else None  # an untracked cpu device: an upload, or a no-op


def _non_blocking(args: tuple, kwargs: dict) -> bool:
    if "non_blocking" in kwargs:
        return bool(kwargs["non_blocking"])
    return any(a is True for a in args[2:3])  # .to(device, dtype, non_blocking) positional forms


def _fresh(out: torch.Tensor, src: torch.Tensor, c: Counter, *, device: bool) -> torch.Tensor:
    """The result of a copy to the other side as a tensor of its own: CPU's `.to` hands back
    its input (or a device-marked result) where a GPU would have copied."""
    if device and _key(out) == _key(src) or not device and c.is_device(out):
        c.paused += 1
        try:
            out = out.clone()
        finally:
            c.paused -= 1
    if device:
        c.mark_device(out)
    return out


class _Functions(TorchFunctionMode):
    def __init__(self, counter: Counter):
        super().__init__()
        self.c = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.c
        if c.paused:
            return func(*args, **kwargs)
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            with _Functions(c):  # this mode is off while it handles a call: the engine runs under a fresh one
                return _backward(func, args, kwargs)
        name = getattr(func, "__name__", "")
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name == "__get__" and getattr(func, "__self__", None) is _DEVICE_ATTR:
            out = func(*args, **kwargs)
            if c.is_device(src):
                c._device_objects[id(out)] = out
            return out
        if name in VALUE_READS and c.is_device(src):
            c.sync(f"Tensor.{name}() of a device tensor")
        if name in ("to", "cuda", "cpu") and src is not None:
            return self._move(func, name, src, args, kwargs)
        if name == "new_tensor" and c.is_device(src):
            c.add("h2d")
            c.sync("Tensor.new_tensor(data) on a device (a blocking copy of Python data)")
            out = func(*args, **kwargs)
            c.mark_device(out)
            return out
        if func in FACTORIES:
            dev = kwargs.get("device")
            host = dev is None or (isinstance(dev, str) and dev.startswith("cpu"))
            if not host and name in ("tensor", "as_tensor", "asarray") and not (args and isinstance(args[0], torch.Tensor)):
                c.add("h2d")
                c.sync(f"torch.{name}(data, device=) (a blocking copy of Python data)")
            with c.call(host):
                out = func(*args, **kwargs)
            if not host:
                c.mark_device(out)
            return out
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        host = bool(tensors) and not any(c.is_device(t) for t in tensors)
        with c.call(host):
            return func(*args, **kwargs)

    def _move(self, func, name, src, args, kwargs):
        c = self.c
        target = _target(c, src, name, args, kwargs)
        on_device = c.is_device(src)
        if target == "host" and on_device:
            if name == "cpu" or not _non_blocking(args, kwargs):
                c.sync(f"blocking device->host .{name}()")
            with c.call(True):
                out = _fresh(func(*args, **kwargs), src, c, device=False)
            c.add("d2h", op=(name, (src,), {}, out))
            return out
        if target == "device" and not on_device:
            if not _non_blocking(args, kwargs):
                c.sync(f"blocking host->device .{name}()")
            with c.call(True):
                out = _fresh(func(*args, **kwargs), src, c, device=True)
            c.add("h2d", op=(name, (src,), {}, out))
            return out
        with c.call(not on_device):
            return func(*args, **kwargs)


def _backward(func, args, kwargs):
    """`loss.backward()` / `torch.autograd.backward(...)` run by the autograd engine with the
    modes on (a mode handling the call itself would be off for the whole backward)."""
    if func is torch.Tensor.backward:
        tensor, *rest = args
        gradient = kwargs.pop("gradient", rest[0] if rest else None)
        tensors, grads = (tensor,), (gradient,)
    else:
        tensors = args[0] if args else kwargs.pop("tensors")
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        grads = kwargs.pop("grad_tensors", args[1] if len(args) > 1 else None)
        grads = (None,) * len(tensors) if grads is None else ((grads,) if isinstance(grads, torch.Tensor) else tuple(grads))
    if kwargs.get("inputs") is not None or kwargs.get("create_graph"):
        raise NotImplementedError("the counted backward takes no inputs= / create_graph=")
    grads = tuple(torch.ones_like(t) if g is None else g for t, g in zip(tensors, grads))
    torch.autograd.graph._engine_run_backward(
        tensors, grads, bool(kwargs.get("retain_graph")), False, (), allow_unreachable=True, accumulate_grad=True
    )


class _Aten(TorchDispatchMode):
    def __init__(self, counter: Counter):
        super().__init__()
        self.c = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.c
        if c.paused:
            return func(*args, **kwargs)
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        dev = [t for t in tensors if c.is_device(t)]
        if name == "copy_":
            return self._copy(func, args, kwargs)
        on_device = bool(dev) or (not tensors and not c.in_host_call())
        out = func(*args, **kwargs)
        if not on_device:
            return out  # host work
        if not (func._schema.is_mutable and tensors and not c.is_device(args[0])):
            c.mark_device(out)
        if ns in ("c10d", "_c10d_functional"):
            c.add("collectives", op=(func, args, kwargs, out))
        elif name in SYNC_OPS or (name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 2):
            c.sync(f"aten.{name}")
        elif any(t.dim() > 0 and not c.is_device(t) for t in tensors):
            shape = next(tuple(t.shape) for t in tensors if t.dim() > 0 and not c.is_device(t))
            c.sync(f"aten.{name} reads a host tensor {shape} (an implicit pageable host->device copy)")
        elif not func.is_view and name not in NOT_KERNELS:
            c.add("kernels", op=(func, args, kwargs, out))
            if c.active:
                c.kernel_names[name] += 1
        return out

    def _copy(self, func, args, kwargs):
        c = self.c
        dst, src = args[0], args[1]
        non_blocking = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
        d_dev, s_dev = c.is_device(dst), c.is_device(src)
        out = func(*args, **kwargs)
        op = (func, args, kwargs, out)
        if d_dev and not s_dev and src.dim() > 0:
            c.add("h2d", op=op)
            if not non_blocking:
                c.sync("blocking host->device copy_")
        elif s_dev and not d_dev:
            c.add("d2h", op=op)
            if not non_blocking:
                c.sync("blocking device->host copy_")
        elif d_dev:
            c.add("kernels", op=op)
            if c.active:
                c.kernel_names["copy_"] += 1
        return out
