"""flash-attn 2.x varlen kernels (v2.6.0 ... v2.8.x) behind the packed-kernel contract.

Where it sits: the "flash_attn" backend, driven by `packed.py`; `select.py` picks it on
CUDA when `detect` accepts the installed release. Calls the private varlen pair of
`flash_attn.flash_attn_interface` (what `flash_attn_varlen_func` calls), because the
backward must start from the FINAL merged out/lse (FlashAttention-2, Algorithm 2).
Releases are told apart by version and the registered op schema, never by
`inspect.signature`; each release's argument names and return tuples are emulated with
their exact signatures in `tests/helpers/emulated_backends.py`.
Conventions: lse [H, total_q] float32 (+inf for a row with no key), bottom-right causal
and windows, softcap 0.0 = none, GQA native. Release table: docs/DESIGN.md "Devices and kernels"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from hf_longctx._compat import parse_version

OLDEST, NEWEST = (2, 6), (3,)  # the `flash` extra's bounds in pyproject.toml
_WINDOW_ARGS = {"window_size_left", "window_size_right", "softcap", "softmax_scale", "causal"}


@dataclass(frozen=True)
class FlashAttnAPI:
    version: tuple[int, ...]
    varlen_forward: Callable
    varlen_backward: Callable
    window_tuple: bool  # v2.6: window_size=(left, right); v2.7+: window_size_left/right


def detect(version: str | None, interface, ops) -> tuple[FlashAttnAPI | None, str | None]:
    """(api, None) for a supported release, (None, reason) otherwise. `interface` is
    `flash_attn.flash_attn_interface`, `ops` is `torch.ops.flash_attn` (None if absent)."""
    if version is None:
        return None, "flash-attn reports no __version__"
    release = parse_version(version)
    if not OLDEST <= release < NEWEST:
        return None, f"flash-attn {version} is outside the supported range >= 2.6, < 3 (varlen lse layout and window arguments differ)"
    fwd = getattr(interface, "_flash_attn_varlen_forward", None)
    bwd = getattr(interface, "_flash_attn_varlen_backward", None)
    if fwd is None or bwd is None:
        return None, f"flash-attn {version} has no _flash_attn_varlen_forward/_backward"
    if release >= (2, 7) and ops is not None:  # custom ops: check the registered schema
        for name in ("_flash_attn_varlen_forward", "_flash_attn_varlen_backward"):
            op = getattr(ops, name, None)
            schema = None if op is None else getattr(getattr(op, "default", None), "_schema", None)
            if schema is None:
                continue  # registered as plain functions (torch without custom-op support)
            args = {a.name for a in schema.arguments}
            if not _WINDOW_ARGS <= args:
                return None, f"flash-attn {version} op {name} lacks {sorted(_WINDOW_ARGS - args)} in its schema {schema}"
    return FlashAttnAPI(release, fwd, bwd, window_tuple=release < (2, 7)), None


def deterministic() -> bool:
    """flash-attn's backward accumulates dq with atomic adds unless told `deterministic=True`
    (a slower, ordered reduction); asked for whenever `torch.use_deterministic_algorithms(True)`
    is on (also with `warn_only`, where torch's own flash backward stays non-deterministic: this
    kernel has the ordered path, so it is taken)."""
    return torch.are_deterministic_algorithms_enabled()


def _window(api: FlashAttnAPI, left: int, right: int) -> dict:
    if api.window_tuple:
        return {"window_size": (left, right)}
    return {"window_size_left": left, "window_size_right": right}


@dataclass(frozen=True)
class FlashAttnKernel:
    api: FlashAttnAPI

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale, causal, left, right, softcap):
        res = self.api.varlen_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale, causal=causal,
            **_window(self.api, left, right), softcap=softcap or 0.0, alibi_slopes=None, return_softmax=False,
            block_table=None,  # required (no default) in v2.6.0 / v2.6.0.post1; optional from v2.6.1
        )
        out, lse = (res[0], res[5]) if self.api.window_tuple else (res[0], res[1])
        return out, lse.masked_fill(torch.isposinf(lse), float("-inf"))  # [T, H, D], [H, T]; +inf = no key

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, scale, causal, left, right, softcap):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        safe_lse = lse.masked_fill(torch.isneginf(lse), float("inf")).contiguous()  # exp(s - inf) = 0
        self.api.varlen_backward(
            dout, q, k, v, out, safe_lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale,
            causal=causal, **_window(self.api, left, right), softcap=softcap or 0.0, alibi_slopes=None,
            deterministic=deterministic(), rng_state=None,
        )  # writes dq, dk, dv in place in every release
        return dq, dk, dv
