"""CPU emulations of the GPU kernels the state-passing mixers call, with their exact signatures.

Where it sits: test support for `ops/mixers/gdn_state.py` and `ops/mixers/mamba2_state.py`
(tests/unit/test_mixer_state.py, tests/distributed/test_hybrid_state.py).

- `chunk_gated_delta_rule`: flash-linear-attention's `fla.ops.gated_delta_rule.chunk_gated_delta_rule`
  (read from fla-org/flash-linear-attention main, fla/ops/gated_delta_rule/chunk.py): q/k
  [B, T, H, K], v [B, T, HV, V] (GVA: HV % H == 0), g/beta [B, T, HV], `initial_state`
  [N, HV, K, V] with N sequences (`cu_seqlens` [N+1], then B must be 1), returns
  (o in q's dtype, final_state [N, HV, K, V] float32 or None); refuses chunk_size outside
  {16, 32, 64} and K > 256 as the kernel does.
- `mamba_chunk_scan_combined`: mamba_ssm's `ops/triton/ssd_combined.py` entry point (state-spaces/
  mamba main): x [B, L, H, P], dt [B, L, H], A [H], B/C [B, L, G, N], D [H] or [H, P],
  initial_states [B, H, P, N], seq_idx int32 [B, L] (the state restarts where it changes; the
  final state is the last sequence's); returns out in x's dtype, and with return_final_states
  (out, final_states) in `state_dtype` or else C's dtype; its asserts are kept.

Both compute with transformers' reference torch paths (the undecorated functions), one
sequence at a time: a reference, not a kernel. `calls` counts invocations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class FLAEmulation:
    def __init__(self):
        self.calls = 0

    def chunk_gated_delta_rule(
        self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False, cu_seqlens=None,
        cu_seqlens_cpu=None, chunk_indices=None, cp_context=None, **kwargs,
    ):
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

        torch_path = getattr(torch_chunk_gated_delta_rule, "__wrapped__", torch_chunk_gated_delta_rule)
        self.calls += 1
        if q.shape[2] != k.shape[2]:
            raise ValueError(f"q and k must have the same number of heads, got {q.shape[2]} and {k.shape[2]}")
        H, HV, K = q.shape[2], v.shape[2], k.shape[-1]
        if HV % H:
            raise ValueError(f"For GVA, num_v_heads (HV={HV}) must be evenly divisible by num_heads (H={H})")
        if kwargs.pop("chunk_size", 64) not in (16, 32, 64) or K > 256:
            raise ValueError("chunk_size must be 16, 32 or 64 and K <= 256")
        if scale is not None and abs(scale - K**-0.5) > 1e-12:
            raise NotImplementedError("the emulation computes with the default scale K ** -0.5")
        if use_beta_sigmoid_in_kernel or state_v_first or cp_context is not None:
            raise NotImplementedError("not emulated")
        if cu_seqlens is None:
            spans, rows = [(0, q.shape[1])], q.shape[0]
        else:
            if q.shape[0] != 1:
                raise ValueError(f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`.")
            cu = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
            if initial_state is not None and initial_state.shape[0] != len(cu) - 1:
                raise ValueError(f"expected {len(cu) - 1} initial states, got {initial_state.shape[0]}")
            spans, rows = list(zip(cu[:-1], cu[1:])), 1
        outs, finals = [], []
        for i, (lo, hi) in enumerate(spans):
            h0 = None
            if initial_state is not None:
                h0 = initial_state if cu_seqlens is None else initial_state[i : i + 1]
            o, fin = torch_path(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g=g[:, lo:hi], beta=beta[:, lo:hi], initial_state=h0,
                                output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            outs.append(o.to(q.dtype))
            finals.append(fin)
        o = torch.cat(outs, dim=1)
        if not output_final_state:
            return o, None
        return o, torch.cat(finals, dim=0).float().reshape(-1 if cu_seqlens is not None else rows, HV, K, v.shape[-1])


class MambaSSMEmulation:
    def __init__(self):
        self.calls = 0

    def mamba_chunk_scan_combined(
        self, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None, cu_seqlens=None,
        dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, return_varlen_states=False,
        state_dtype=None,
    ):
        from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan

        torch_path = getattr(mamba2_chunk_scan, "__wrapped__", mamba2_chunk_scan)
        self.calls += 1
        batch, seqlen, nheads, headdim = x.shape
        _, _, ngroups, dstate = B.shape
        assert nheads % ngroups == 0
        assert B.shape == (batch, seqlen, ngroups, dstate) and C.shape == B.shape
        assert dt.shape == (batch, seqlen, nheads)
        assert A.shape == (nheads,)
        if D is not None:
            assert D.shape == (nheads, headdim) or D.shape == (nheads,)
        if initial_states is not None:
            assert initial_states.shape == (batch, nheads, headdim, dstate)
        if return_varlen_states:
            raise NotImplementedError("not emulated (and varlen states have no backward in mamba_ssm)")
        kw = dict(D=D if D is None or D.dim() == 1 else None, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                  return_final_states=return_final_states)
        if seq_idx is None:
            res = torch_path(x, dt, A, B, C, chunk_size, initial_states=initial_states, **kw)
        else:
            assert seq_idx.shape == (batch, seqlen) and seq_idx.dtype == torch.int32
            assert initial_states is None, "the emulation restarts every sequence from zero state"
            rows = []
            for r in range(batch):
                ids = seq_idx[r].tolist()
                cuts = [0] + [t for t in range(1, seqlen) if ids[t] != ids[t - 1]] + [seqlen]
                parts = [torch_path(*(t[r : r + 1, a:b] for t in (x, dt)), A, *(t[r : r + 1, a:b] for t in (B, C)), chunk_size, **kw)
                         for a, b in zip(cuts[:-1], cuts[1:])]
                outs = [p[0] if return_final_states else p for p in parts]
                rows.append((torch.cat(outs, 1), parts[-1][1] if return_final_states else None))
            out = torch.cat([o for o, _ in rows])
            res = (out, torch.cat([f for _, f in rows])) if return_final_states else out
        out, final = res if return_final_states else (res, None)
        if D is not None and D.dim() == 2:
            out = out + x.float() * D
        if z is not None:
            out = out * F.silu(z.float())
        out = out.to(x.dtype)
        if not return_final_states:
            return out
        return out, final.to(state_dtype if state_dtype is not None else C.dtype)


def recurrent_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                         **kwargs):
    """The gated delta rule token by token IN THE INPUTS' DTYPE (transformers' torch paths cast
    to fp32): the float64 reference of the exactness tests. Same signature and return as
    `torch_chunk_gated_delta_rule`; GVA by repeating q/k per value head."""
    if q.shape[2] != v.shape[2]:
        q, k = (t.repeat_interleave(v.shape[2] // t.shape[2], 2) for t in (q, k))
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    b, length, h, dk = q.shape
    q = q * dk**-0.5
    state = q.new_zeros(b, h, dk, v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    outs = []
    for t in range(length):
        state = state * g[:, t].exp()[..., None, None]  # [B, H, D_k, D_v]
        delta = (v[:, t] - (state * k[:, t, :, :, None]).sum(-2)) * beta[:, t, :, None]  # [B, H, D_v]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((state * q[:, t, :, :, None]).sum(-2))  # [B, H, D_v]
    return torch.stack(outs, 1), (state if output_final_state else None)
