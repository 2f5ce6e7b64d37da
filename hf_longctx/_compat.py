"""Every version and kernel probe of the project, in one place.

Where it sits: below everything. `ops/kernels.py` asks which local attention kernels
exist (aten CPU flash op, flash-attn on CUDA); integrations ask for library versions.
Probes are plain functions evaluated on call: no module state, no environment flags.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect

import torch


def package_version(name: str) -> tuple[int, ...] | None:
    """Numeric release tuple of an installed distribution, or None if not installed."""
    try:
        text = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def torch_version() -> tuple[int, ...]:
    return package_version("torch") or tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def transformers_version() -> tuple[int, ...] | None:
    return package_version("transformers")


def has_cpu_flash_op() -> bool:
    """torch ships the CPU flash-attention op pair that returns the log-sum-exp."""
    ops = torch.ops.aten
    return hasattr(ops, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
        ops, "_scaled_dot_product_flash_attention_for_cpu_backward"
    )


def has_flash_attn() -> bool:
    """flash-attn >= 2.7 is importable, CUDA is up, and its private forward/backward take
    the (window_size_left, window_size_right, softcap) arguments `ops/kernels.py` passes.
    Unverified in this workplace (no GPU); any mismatch falls back to the math kernel."""
    if not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None:
        return False
    version = package_version("flash_attn") or package_version("flash-attn")
    if version is None or version < (2, 7):
        return False
    try:
        from flash_attn import flash_attn_interface as fai
    except ImportError:
        return False
    needed = {"window_size_left", "window_size_right", "softcap", "softmax_scale", "causal"}
    for fn_name in ("_flash_attn_forward", "_flash_attn_backward"):
        fn = getattr(fai, fn_name, None)
        if fn is None:
            return False
        try:
            params = set(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            return False
        if not needed <= params:
            return False
    return True
