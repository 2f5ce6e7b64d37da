"""Host-built tensors onto their device without blocking the host.

Where it sits: the lowest floor (torch only), the one rule for every host -> device copy:
`upload` (one tensor: the packed backend's block index, `patch()`'s signature),
`upload_stacked` (a shard's per-token tensors, one copy per dtype) and `to_device` (the
step DataLoader's host shards, where `Trainer._prepare_input` would block on `.to(device)`).
Guarantee: on CUDA the tensor is staged with `pin_memory()` (torch's caching host allocator
keeps it until the copy has run, so dropping it at once is safe) and copied non-blocking;
elsewhere the copy is `.to(device, non_blocking=True)`, a no-op when already there."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def _pins(device: torch.device, pin: bool) -> bool:
    return pin and device.type == "cuda" and torch.cuda.is_available()


def _copy(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    if t.device.type == "cpu" and _pins(device, pin) and not t.is_pinned():
        t = t.pin_memory()  # page-locked staging: the copy below can run asynchronously
    return t.to(device, non_blocking=True)  # t itself when it is already there


def upload(host: torch.Tensor, device) -> torch.Tensor:
    """One host-built tensor on `device` without blocking the host (pinned staging on CUDA)."""
    return _copy(host, torch.device(device), True)


def to_device(data: Any, device: torch.device | str, *, pin: bool = True) -> Any:
    """`data` (a tensor, or mappings / lists / tuples of them; anything else as is) with every
    tensor on `device`, copied without blocking the host, each tensor once (a shard's
    `labels` IS its `shift_labels`: one copy, still one tensor); `pin`: stage host tensors in
    pinned memory first on CUDA (the Trainer's `dataloader_pin_memory`)."""
    return _moved(data, torch.device(device), pin, {})


def _moved(data: Any, device: torch.device, pin: bool, done: dict[int, torch.Tensor]) -> Any:
    if isinstance(data, Mapping):
        return type(data)({k: _moved(v, device, pin, done) for k, v in data.items()})
    if isinstance(data, (list, tuple)) and not hasattr(data, "_fields"):  # not a namedtuple
        return type(data)(_moved(v, device, pin, done) for v in data)
    if isinstance(data, torch.Tensor):
        if id(data) not in done:  # `data` stays referenced by the caller's structure: ids are stable
            done[id(data)] = _copy(data, device, pin)
        return done[id(data)]
    return data


def upload_stacked(tensors: Mapping[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """Host tensors of one shape onto `device` with one copy per dtype: stacked on the host
    ([K, *shape], contiguous), pinned on CUDA, copied non-blocking, split back into K
    contiguous views on the device (same keys, values and dtypes)."""
    device = torch.device(device)
    by_dtype: dict[torch.dtype, list[str]] = {}
    for key, t in tensors.items():
        by_dtype.setdefault(t.dtype, []).append(key)
    out: dict[str, torch.Tensor] = {}
    for keys in by_dtype.values():
        if len(keys) == 1:
            out[keys[0]] = _copy(tensors[keys[0]].contiguous(), device, pin=True)
            continue
        stacked = torch.stack([tensors[k] for k in keys])  # [K, *shape] on the host
        moved = _copy(stacked, device, pin=True)
        out.update(zip(keys, moved.unbind(0)))  # K views [*shape], each contiguous
    return {key: out[key] for key in tensors}
