"""Which local attention backend runs a call: probed once per process, chosen once per micro-batch.

Where it sits: `ops/kernels.batch_backend` calls `backend_for(q, softcap=...)` once per
micro-batch and (device, dtype, head dim, softcap) for USP, ring and FPDT (the caller keeps
the choice: not per layer, never per tile; per micro-batch, since torch's flash
implementation is a process-wide switch the user may flip between steps); a call with no
caller's choice picks here per call. `probe_env` reads the cached probes of
`_compat.py` into a frozen `KernelEnv`; `select_backend` is a pure function of that
environment and the call's dtype, head dim and softcap, so tests hand it emulated ones.
Preference on CUDA: torch's flash ops under FA3/FA4 -> flash-attn 2.x (softcap) -> torch's
FA2 -> the math kernel, with ONE warning naming why each fast kernel refused. On CPU: the
aten CPU flash op, or the math kernel for softcap, without a warning."""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch

from hf_longctx import _compat
from hf_longctx.ops import math_kernel
from hf_longctx.ops.backends import aten_cpu, flash_attn, torch_flash
from hf_longctx.ops.backends.capabilities import refusal
from hf_longctx.ops.backends.packed import PackedBackend
from hf_longctx.ops.backends.tiled import TiledBackend

MATH = TiledBackend("math", math_kernel.math_forward, math_kernel.math_backward, expand_gqa=False)
ATEN_CPU = TiledBackend("aten_cpu", aten_cpu.aten_forward, aten_cpu.aten_backward, expand_gqa=True)


@dataclass(frozen=True)
class KernelEnv:
    """What this process can run on one device type."""

    device: str
    capability: tuple[int, int] | None = None
    flash_attn: object | None = None  # a kernel adapter (flash_attn.FlashAttnKernel) or None
    flash_attn_absent: str = "flash-attn is not installed"
    torch_flash: object | None = None  # torch_flash.TorchFlashKernel or None
    torch_flash_absent: str = "this torch build has no CUDA flash kernels"
    torch_impl: str | None = None  # "FA3" / "FA4" when torch runs them
    cpu_op: bool = False


def probe_env(device: torch.device) -> KernelEnv:
    if device.type == "cpu":
        return KernelEnv("cpu", cpu_op=_compat.has_cpu_flash_op())
    if device.type != "cuda":
        return KernelEnv(device.type)
    fa, fa_reason, tf, tf_reason = _cuda_kernels()
    impl = _compat.torch_flash_impl() if tf is not None else None  # read per call: the user may switch it
    index = device.index if device.index is not None else torch.cuda.current_device()
    return KernelEnv("cuda", _compat.cuda_capability(index), fa, fa_reason, tf, tf_reason, impl)


@functools.cache
def _cuda_kernels() -> tuple:
    """(flash-attn adapter or None, why not, torch flash adapter or None, why not): the op
    schemas are read once per process, not per attention call."""
    fa, fa_reason = None, "flash-attn is not installed"
    modules = _compat.flash_attn_modules()
    if modules is not None:
        api, fa_reason = flash_attn.detect(*modules)
        fa = None if api is None else flash_attn.FlashAttnKernel(api)
    tf, tf_reason = None, "this torch build has no CUDA flash kernels"
    if _compat.has_torch_cuda_flash():
        fwd, bwd = torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward
        tf_reason = torch_flash.detect(fwd, bwd)
        tf = None if tf_reason else torch_flash.TorchFlashKernel(fwd, bwd)
    return fa, fa_reason, tf, tf_reason or ""


def select_backend(env: KernelEnv, *, dtype: torch.dtype, head_dim: int, softcap: float | None, mask: bool = False):
    """The backend for one call. `mask`: the caller holds an arbitrary boolean mask (only
    the tile kernels take one)."""
    if env.device == "cpu":
        ok = env.cpu_op and refusal("aten_cpu", device="cpu", dtype=dtype, head_dim=head_dim, softcap=softcap) is None
        return ATEN_CPU if ok else MATH
    if env.device != "cuda" or mask:
        return MATH
    candidates = []
    if env.torch_impl is not None:
        candidates.append(("torch_flash", env.torch_flash, env.torch_flash_absent))
    candidates += [("flash_attn", env.flash_attn, env.flash_attn_absent), ("torch_flash", env.torch_flash, env.torch_flash_absent)]
    reasons = []
    for name, kernel, absent in candidates:
        why = absent if kernel is None else refusal(
            name, device="cuda", dtype=dtype, head_dim=head_dim, softcap=softcap, capability=env.capability
        )
        if why is None:
            return _packed(name if name != "torch_flash" or env.torch_impl is None else f"torch_flash[{env.torch_impl}]", kernel)
        if why not in reasons:
            reasons.append(why)
    # The warnings module shows one message per call site once (default filter): one warning per reason.
    warnings.warn(
        f"hf_longctx: local attention runs the pure-torch math kernel on CUDA (slow) because {'; '.join(reasons)}",
        RuntimeWarning, stacklevel=3,
    )
    return MATH


@functools.lru_cache(maxsize=16)
def _packed(name: str, kernel) -> PackedBackend:
    """One backend object per kernel adapter: every call of every layer gets the same one."""
    return PackedBackend(name, kernel)


def backend_for(q: torch.Tensor, *, softcap: float | None, mask: bool = False):
    return select_backend(probe_env(q.device), dtype=q.dtype, head_dim=q.shape[-1], softcap=softcap, mask=mask)
