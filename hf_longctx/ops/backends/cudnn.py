"""cuDNN attention through torch's own ops, behind the packed-kernel contract.

Where it sits: the "cudnn" backend, driven by `packed.py` with every causal call made square
(`square_causal.py`); `select.py` offers it on CUDA when `detect` accepts the installed torch
and cuDNN. Calls `aten::_cudnn_attention_forward` / `_backward` (the ops torch's jagged
nested-tensor SDPA runs, `torch/nested/_internal/sdpa.py`) by their torch 2.13 schemas, emulated
in `tests/helpers/emulated_cudnn.py`; torch's own `varlen.py` cuDNN branch is switched off in
2.13 and passes the backward's arguments in flash's order, so it is no model here.
Conventions read from torch's sources (`aten/src/ATen/native/cudnn/MHA.cpp`): varlen q/k/v
[T, H(_kv), D], GQA native; `is_causal` top-left per sequence; no window, no softcap; LSE in
natural-log units, [H, T] float32 in newer sources and [T, H, 1] in older ones (both taken,
the backward is handed the layout the forward returned); older sources address each sequence
as cum_seq * H * D whatever the strides, so q/k/v/out/dout go in contiguous and 16-byte
aligned (a copy where they are not, counted in `copies`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

# NeMo-RL runs packed sequences through cuDNN attention only from cuDNN 9.14 on.
MIN_PACKED_VERSION = 91400
_FORWARD_ARGS = ("query", "key", "value", "attn_bias", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
                 "compute_log_sumexp", "dropout_p", "is_causal", "return_debug_mask", "scale")
_BACKWARD_ARGS = ("grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset",
                  "attn_bias", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "scale")


def version_text(version: int) -> str:
    """cuDNN's integer version as major.minor.patch (91400 -> 9.14.0)."""
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


def detect(forward_op, backward_op, cudnn_version: int | None, *, sdp_enabled: bool = True) -> str | None:
    """Why the aten pair cannot serve packed documents here (None if it can): the registered
    schemas must be the ones this adapter calls (names, order, `scale` keyword-only), the
    runtime cuDNN new enough for packed sequences, and cuDNN attention not switched off."""
    for op, names in ((forward_op, _FORWARD_ARGS), (backward_op, _BACKWARD_ARGS)):
        schema = getattr(getattr(op, "default", None), "_schema", None)
        if schema is None:
            return f"{op} has no registered schema"
        got = tuple(a.name for a in schema.arguments)
        if got != names or not schema.arguments[-1].kwarg_only:
            return f"{schema.name} takes {got}, not the {names} (scale keyword-only) this adapter calls"
    if cudnn_version is None:
        return "this torch build has no cuDNN"
    if cudnn_version < MIN_PACKED_VERSION:
        return (f"cuDNN {version_text(cudnn_version)} is older than {version_text(MIN_PACKED_VERSION)}, the first "
                "release that runs packed (varlen) documents correctly")
    if not sdp_enabled:
        return "cuDNN attention is switched off (torch.backends.cuda.cudnn_sdp_enabled() is False)"
    return None


def _aligned(x: torch.Tensor) -> bool:
    """Contiguous [T, H, D] on a 16-byte boundary: what every torch release's varlen path reads right."""
    return x.is_contiguous() and x.data_ptr() % 16 == 0


@dataclass(frozen=True)
class CudnnKernel:
    forward_op: Callable  # torch.ops.aten._cudnn_attention_forward
    backward_op: Callable  # torch.ops.aten._cudnn_attention_backward
    copies: Counter = field(default_factory=Counter, compare=False, hash=False)  # tensors copied to an aligned layout
    seen: dict = field(default_factory=dict, compare=False, hash=False)  # the LSE layout the forward returned
    square_causal = True  # `packed.py`: top-left causal, every causal call square

    def _ready(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if _aligned(x):
            return x
        self.copies[name] += 1
        return x.clone(memory_format=torch.contiguous_format)  # a fresh allocation: contiguous and aligned

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale, causal, left, right, softcap):
        if softcap is not None or (left, right) != (-1, -1):
            raise ValueError(f"cuDNN attention has no softcap or window (softcap={softcap}, left={left}, right={right}); "
                             "the dispatcher must not send them here")
        q, k, v = self._ready("q", q), self._ready("k", k), self._ready("v", v)
        res = self.forward_op(q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0, causal, False, scale=scale)
        out, lse = res[0], res[1]
        if lse.dim() == 3:  # [T, H, 1]: the older sources' layout
            self.seen["lse"] = "T,H,1"
            lse = lse[:, :, 0].t()  # [H, T] view
        else:
            self.seen["lse"] = "H,T"
        return out, lse.contiguous()  # [T, H, D], [H, T]

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, scale, causal, left, right, softcap):
        layout = self.seen.get("lse")
        if layout is None:
            raise RuntimeError("cuDNN attention backward before any forward in this process: the LSE layout the "
                               "installed torch expects is unknown")
        q, k, v = self._ready("q", q), self._ready("k", k), self._ready("v", v)
        out, dout = self._ready("out", out), self._ready("dout", dout)
        lse = lse.contiguous() if layout == "H,T" else lse.t().contiguous().unsqueeze(-1)  # [H, T] or [T, H, 1]
        unused = torch.empty(0, dtype=torch.int64, device=q.device)  # philox seed / offset: no dropout
        dq, dk, dv = self.backward_op(dout, q, k, v, out, lse, unused, unused, None, cu_q, cu_k, max_q, max_k, 0.0,
                                      causal, scale=scale)
        return dq, dk, dv
