"""CPU emulation of cuDNN attention through torch's ops: `aten::_cudnn_attention_forward/_backward`.

Where it sits: test support for `ops/backends/cudnn.py` (tests/unit/test_cudnn_backend.py). The
emulated ops have the installed torch's exact schemas (names, order, defaults, keyword-only
`scale`: `_as_installed` binds every call against them) and the varlen semantics read from
torch's `aten/src/ATen/native/cudnn/MHA.cpp`: q/k/v [T, H(_kv), D] with cumulative lengths, GQA
native, `is_causal` TOP-LEFT aligned per sequence (the real kernel computes a rectangular
causal sequence from its top-left corner, silently: so does this one, and counts it), no
window; the LSE in natural-log units as [H, T] float32 (`lse_layout="H,T"`, newer sources) or
[T, H, 1] (`"T,H,1"`, older sources), the backward taking the same layout; the older sources'
per-sequence addressing cum_seq x H x D whatever the strides (`packed_offsets=True` reads every
operand as if contiguous, so a strided view gives wrong rows, as there) and a fault on an
operand not 16-byte aligned. fp16/bf16 only (float64 with `allow_float64` for wiring tests).
"""

from __future__ import annotations

import torch

from tests.helpers.emulated_backends import _as_installed, _Sim


class CudnnOps:
    """`forward` / `backward` shaped like the installed aten ops; `sim` counts the calls,
    `rectangular_causal` the causal calls with a sequence whose query and key lengths differ."""

    def __init__(self, *, lse_layout: str = "H,T", packed_offsets: bool = True, allow_float64: bool = False):
        if lse_layout not in ("H,T", "T,H,1"):
            raise ValueError(f"lse_layout must be 'H,T' or 'T,H,1', got {lse_layout!r}")
        self.sim = sim = _Sim(allow_float64, top_left=True)
        self.lse_layout, self.packed_offsets = lse_layout, packed_offsets
        self.rectangular_causal = 0
        emu = self

        def forward(query, key, value, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, compute_log_sumexp,
                    dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
            assert attn_bias is None and dropout_p == 0.0 and not return_debug_mask and compute_log_sumexp
            q, k, v = (emu._read(t) for t in (query, key, value))
            emu._note(cum_seq_q, cum_seq_k, is_causal)
            scale = scale if scale is not None else q.shape[-1] ** -0.5
            out, lse = sim.forward(q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, scale, is_causal, -1, -1, None)
            lse = lse.contiguous() if emu.lse_layout == "H,T" else lse.t().contiguous().unsqueeze(-1)
            seed = torch.empty((), dtype=torch.int64)
            return out, lse, cum_seq_q, cum_seq_k, max_q, max_k, seed, seed, torch.empty(0)

        def backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q,
                     cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None):
            assert attn_bias is None and dropout_p == 0.0
            assert isinstance(philox_seed, torch.Tensor) and isinstance(philox_offset, torch.Tensor)
            q, k, v, o, do = (emu._read(t) for t in (query, key, value, out, grad_out))
            emu._note(cum_seq_q, cum_seq_k, is_causal)
            lse = emu._lse_in(logsumexp, q.shape[1], q.shape[0])
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            scale = scale if scale is not None else q.shape[-1] ** -0.5
            sim.backward(do, q, k, v, o, lse, dq, dk, dv, cum_seq_q, cum_seq_k, max_q, max_k, scale, is_causal, -1, -1,
                         None)
            return dq, dk, dv

        self.forward = _as_installed(forward, torch.ops.aten._cudnn_attention_forward.default)
        self.backward = _as_installed(backward, torch.ops.aten._cudnn_attention_backward.default)

    def _read(self, x: torch.Tensor) -> torch.Tensor:
        """The operand as the kernel reads it: a misaligned base faults; with `packed_offsets`
        every sequence starts at cum_seq x H x D elements, i.e. the memory read as contiguous."""
        if x.data_ptr() % 16:
            raise RuntimeError(f"misaligned address: operand at {x.data_ptr()} is not 16-byte aligned")
        if self.packed_offsets and not x.is_contiguous():
            t, h, d = x.shape
            return torch.as_strided(x, (t, h, d), (h * d, d, 1))  # the bytes from the view's start, taken as packed
        return x

    def _note(self, cu_q, cu_k, causal: bool) -> None:
        if causal and not torch.equal(cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]):
            self.rectangular_causal += 1

    def _lse_in(self, lse: torch.Tensor, h: int, t: int) -> torch.Tensor:
        """The backward's LSE in the layout of this release, as [H, T]."""
        if self.lse_layout == "H,T":
            if tuple(lse.shape) != (h, t) or not lse.is_contiguous():
                raise RuntimeError(f"cuDNN SDPA expected a contiguous 2D (H, T) = {(h, t)} softmax_lse, got {tuple(lse.shape)}")
            return lse
        if tuple(lse.shape) != (t, h, 1) or not lse.is_contiguous():
            raise RuntimeError(f"cuDNN SDPA expected a contiguous (T, H, 1) = {(t, h, 1)} softmax_lse, got {tuple(lse.shape)}")
        return lse[:, :, 0].t()
