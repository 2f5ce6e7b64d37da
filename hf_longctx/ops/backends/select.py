"""Which local attention backend runs a call: probed once per process, chosen once per micro-batch.

Where it sits: `ops/kernels.batch_backend` calls `backend_for(q, softcap=, window=, choice=)`
once per micro-batch and (device, dtype, head dim, softcap, window) for USP, ring and FPDT (the
caller keeps the choice: not per layer, never per tile; per micro-batch, since torch's flash
implementation is a process-wide switch the user may flip between steps). `probe_env` reads the
cached probes of `_compat.py` into a frozen `KernelEnv`; `select_backend` is a pure function of
that environment, the call and the `AttentionChoice`, so tests hand it emulated ones.
On CUDA: the backend the user named (refused with the reason where it cannot run the call),
else the fastest exact backend measured on this GPU (`AttentionChoice.ranking`, from the
measured fractions of `capacity/gpus.py`), else -- nothing measured -- the kernel torch's flash
ops run, else the one exact kernel left; the math kernel last, with ONE warning naming why each
fast kernel refused. On CPU: the aten CPU flash op, or the math kernel for softcap."""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch

from hf_longctx import _compat
from hf_longctx.ops import math_kernel
from hf_longctx.ops.backends import aten_cpu, cudnn, cudnn_frontend, flash_attn, torch_flash
from hf_longctx.ops.backends.capabilities import refusal
from hf_longctx.ops.backends.packed import PackedBackend
from hf_longctx.ops.backends.tiled import TiledBackend

MATH = TiledBackend("math", math_kernel.math_forward, math_kernel.math_backward, expand_gqa=False)
ATEN_CPU = TiledBackend("aten_cpu", aten_cpu.aten_forward, aten_cpu.aten_backward, expand_gqa=True)
# Where nothing is measured, the packed kernels in this order (torch's flash ops first: the kernel
# every fraction of capacity/gpus.py was derived from).
UNMEASURED_ORDER = ("torch_flash", "flash_attn", "cudnn_frontend", "cudnn")
# The GPUs torch's FA3 / FA4 run on (torch/nn/attention/_fa3.py, _fa4.py: compute capability 9.0; 9.0 or 10.0).
IMPL_CAPABILITY = {"FA3": ((9, 0),), "FA4": ((9, 0), (10, 0))}


@dataclass(frozen=True)
class AttentionChoice:
    """How a call's backend is chosen: `named` -- a backend the user asked for
    (`patch(attention_backend=...)`: "torch_flash", "torch_flash[FA3]", "flash_attn", "cudnn", ...)
    -- else the first exact one of `ranking` (the backends measured on this GPU, fastest first)."""

    named: str | None = None
    ranking: tuple[str, ...] = ()


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
    cudnn: object | None = None  # cudnn.CudnnKernel or None
    cudnn_absent: str = "this torch build has no cuDNN"
    cudnn_frontend: object | None = None  # cudnn_frontend.CudnnFrontendKernel or None
    cudnn_frontend_absent: str = "nvidia-cudnn-frontend is not installed"

    def kernels(self) -> list[tuple[str, str, object | None, str]]:
        """(label, capability row, adapter or None, why absent) of every packed CUDA kernel."""
        label = "torch_flash" if self.torch_impl is None else f"torch_flash[{self.torch_impl}]"
        return [(label, "torch_flash", self.torch_flash, self.torch_flash_absent),
                ("flash_attn", "flash_attn", self.flash_attn, self.flash_attn_absent),
                ("cudnn", "cudnn", self.cudnn, self.cudnn_absent),
                ("cudnn_frontend", "cudnn_frontend", self.cudnn_frontend, self.cudnn_frontend_absent)]


def probe_env(device: torch.device) -> KernelEnv:
    if device.type == "cpu":
        return KernelEnv("cpu", cpu_op=_compat.has_cpu_flash_op())
    if device.type != "cuda":
        return KernelEnv(device.type)
    fa, fa_reason, tf, tf_reason, cd, cd_reason, fe, fe_reason = _cuda_kernels()
    impl = _compat.torch_flash_impl() if tf is not None else None  # read per call: the user may switch it
    if cd is not None and not _compat.cudnn_attention_enabled():  # the user's switch, read per call too
        cd, cd_reason = None, cudnn.detect(cd.forward_op, cd.backward_op, _compat.cudnn_version(), sdp_enabled=False)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return KernelEnv("cuda", _compat.cuda_capability(index), fa, fa_reason, tf, tf_reason, impl, False, cd, cd_reason,
                     fe, fe_reason)


@functools.cache
def _cuda_kernels() -> tuple:
    """(adapter or None, why not) of flash-attn, torch's flash ops, cuDNN through torch's ops and
    cuDNN through cudnn-frontend: the op schemas are read once per process, not per call."""
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
    fwd, bwd = (getattr(torch.ops.aten, n, None) for n in ("_cudnn_attention_forward", "_cudnn_attention_backward"))
    cd_reason = cudnn.detect(fwd, bwd, _compat.cudnn_version())
    cd = None if cd_reason else cudnn.CudnnKernel(fwd, bwd)
    version, ops = _compat.cudnn_frontend_ops() or (None, None)
    fe_reason = cudnn_frontend.detect(version, ops)
    fe = None if fe_reason else cudnn_frontend.CudnnFrontendKernel(ops)
    return fa, fa_reason, tf, tf_reason or "", cd, cd_reason or "", fe, fe_reason or ""


def _why_not_named(env: KernelEnv, named: str) -> str:
    """The reason a named torch_flash variant is not the one torch's flash ops run."""
    running = "its built-in FlashAttention-2" if env.torch_impl is None else env.torch_impl
    if named.startswith("torch_flash["):
        impl = named[len("torch_flash["):-1]
        return (f"torch's flash ops run {running} in this process: call "
                f"torch.nn.attention.activate_flash_attention_impl({impl!r}) before training to run {impl}")
    return (f"torch's flash ops run {running} in this process (torch.nn.attention.activate_flash_attention_impl): "
            f"name 'torch_flash[{env.torch_impl}]', or call torch.nn.attention.restore_flash_attention_impl()")


def _impl_refusal(env: KernelEnv, label: str) -> str | None:
    """Why torch's flash ops under the user's FA3/FA4 switch cannot run on this GPU (torch would raise)."""
    fits = IMPL_CAPABILITY.get(env.torch_impl)
    if not label.startswith("torch_flash[") or fits is None or env.capability is None or tuple(env.capability) in fits:
        return None
    return (f"torch's flash ops run {env.torch_impl}, which runs on compute capability "
            f"{' or '.join(f'{a}.{b}' for a, b in fits)}, not {env.capability[0]}.{env.capability[1]}: "
            "call torch.nn.attention.restore_flash_attention_impl()")


def select_backend(
    env: KernelEnv, *, dtype: torch.dtype, head_dim: int, softcap: float | None, mask: bool = False,
    window: int | None = None, choice: AttentionChoice | None = None,
):
    """The backend for one call. `mask`: the caller holds an arbitrary boolean mask (only the
    tile kernels take one). A named backend that cannot run the call raises ValueError."""
    choice = choice or AttentionChoice()
    named = choice.named
    if named == "math":
        return MATH
    if env.device == "cpu":
        if named not in (None, "aten_cpu"):
            raise ValueError(f"attention_backend={named!r} runs on CUDA; this call runs on cpu (aten_cpu or math here)")
        ok = env.cpu_op and refusal("aten_cpu", device="cpu", dtype=dtype, head_dim=head_dim, softcap=softcap) is None
        if named == "aten_cpu" and not ok:
            raise ValueError(f"attention_backend='aten_cpu' cannot run this call (dtype {dtype}, softcap {softcap}): "
                             "leave attention_backend unset")
        return ATEN_CPU if ok else MATH
    if env.device != "cuda" or mask:
        return MATH
    exact, reasons = {}, {}
    for label, row, kernel, absent in env.kernels():
        why = absent if kernel is None else refusal(
            row, device="cuda", dtype=dtype, head_dim=head_dim, softcap=softcap, capability=env.capability, window=window,
        ) or _impl_refusal(env, label)
        if why is None:
            exact[label] = kernel
        else:
            reasons[label] = why
    if named is not None:
        if named in exact:
            return _packed(named, exact[named])
        why = reasons.get(named) or (_why_not_named(env, named) if named.startswith("torch_flash") else None)
        raise ValueError(
            f"attention_backend={named!r} cannot run this call ({why or 'no such backend here'}); "
            f"exact here: {sorted(exact) or 'none but math'}"
        )
    for label in (*choice.ranking, *([f"torch_flash[{env.torch_impl}]"] if env.torch_impl else []), *UNMEASURED_ORDER):
        if label in exact:
            return _packed(label, exact[label])
    # The warnings module shows one message per call site once (default filter): one warning per reason.
    unique = list(dict.fromkeys(reasons.values()))
    warnings.warn(
        f"hf_longctx: local attention runs the pure-torch math kernel on CUDA (slow) because {'; '.join(unique)}",
        RuntimeWarning, stacklevel=3,
    )
    return MATH


@functools.lru_cache(maxsize=16)
def _packed(name: str, kernel) -> PackedBackend:
    """One backend object per kernel adapter: every call of every layer gets the same one."""
    return PackedBackend(name, kernel)


def backend_for(q: torch.Tensor, *, softcap: float | None, mask: bool = False, window: int | None = None,
                choice: AttentionChoice | None = None):
    return select_backend(probe_env(q.device), dtype=q.dtype, head_dim=q.shape[-1], softcap=softcap, mask=mask,
                          window=window, choice=choice)
