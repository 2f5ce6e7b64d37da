"""Catching host-device synchronisations on CPU: the META device and a dispatch mode.

DEV is the META device: it has no data, so a value read (`.item()`, `.tolist()`,
`nonzero`) raises. `HostDeviceGuard` records (op, why) for every op that would make the
host wait for a real device: a host tensor (dim > 0) read by a device op, or a host ->
device copy that is not `non_blocking` (`uploads` counts every upload). `fake_all_to_all_v`
stands in for `all_to_all_v` with the collective's shapes and autograd edges and no process
group, so every SP rank's index tensors run in one process. Used by
tests/unit/test_mixer_no_sync.py and test_mixer_state.py.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

DEV = torch.device("meta")


class HostDeviceGuard(TorchDispatchMode):
    """Records (op, why) for every op that would synchronise the host on a real device."""

    def __init__(self):
        super().__init__()
        self.syncs: list[tuple[str, str]] = []
        self.uploads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_dev = any(t.device == DEV for t in tensors)
        host = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
        if name in ("_to_copy", "copy_") and host and kwargs.get("device", DEV if name == "copy_" else None) == DEV:
            self.uploads += 1
            if not kwargs.get("non_blocking", args[2] if name == "copy_" and len(args) > 2 else False):
                self.syncs.append((name, "blocking host -> device copy"))
        elif on_dev and host:
            self.syncs.append((name, f"host tensor {tuple(host[0].shape)} read by a device op"))
        return func(*args, **kwargs)


def fake_all_to_all_v(pieces, recv_shapes, group):
    """The collective's shapes and autograd edges without a process group."""
    keep = sum(p.sum() for p in pieces) * 0.0  # keeps every sent piece in the graph
    return [keep + torch.zeros(s, dtype=pieces[0].dtype, device=pieces[0].device) for s in recv_shapes]
