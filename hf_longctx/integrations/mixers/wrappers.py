"""The sequence-parallel forward of each supported linear-mixer family, built per instance.

Where it sits: `registry.REGISTRY` maps each transformers class to one of these (`make`
builds the instance's new forward around a `MixerBinding`; `check` raises ValueError for a
layout it cannot serve). Each reuses the module's own projections, norms and parameters and
replaces only the token-mixing core by `ops/mixers/` (halo convolution; GDN / Mamba-2 head
all-to-all or state passing, per `dispatch.py`; RG-LRU state passing).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.integrations.mixers.binding import MixerBinding
from hf_longctx.integrations.mixers.dispatch import gdn_core, mamba2_core
from hf_longctx.ops.mixers.conv import halo_conv
from hf_longctx.ops.mixers.rglru import rglru_scan_sequence_parallel


# ---- short convolutions: LFM2 / LFM2-MoE / LFM3 ----------------------------------------------


def check_depthwise(conv: torch.nn.Conv1d, name: str) -> None:
    c, k = conv.in_channels, conv.kernel_size[0]
    if conv.groups != c or conv.out_channels != c or conv.padding[0] != k - 1 or conv.stride[0] != 1 or conv.dilation[0] != 1:
        raise ValueError(
            f"{name}: only causal depthwise convolutions are supported (groups = channels, padding = K-1, stride 1, "
            f"dilation 1); got channels {c}, groups {conv.groups}, kernel {k}, padding {conv.padding[0]}, "
            f"stride {conv.stride[0]}, dilation {conv.dilation[0]}"
        )


def short_conv(module: Any, bind: MixerBinding) -> Callable:
    def forward(hidden_states, past_key_values=None, attention_mask=None, **kwargs):
        lay = bind.layout(module, hidden_states)
        bcx = module.in_proj(hidden_states)  # [B, S_local, 3·H]
        b_gate, c_gate, x = bcx.chunk(3, dim=-1)  # [B, S_local, H] each
        conv = halo_conv(b_gate * x, lay, module.conv.weight.squeeze(1), module.conv.bias, bind.rank, bind.group)
        y = c_gate * conv.to(hidden_states.dtype)  # [B, S_local, H]
        return module.out_proj(y)

    return forward


# ---- Gated DeltaNet: Qwen3-Next, Qwen3.5 (+MoE), OLMo-hybrid ---------------------------------


def check_gdn(module: Any, mesh: SPMesh) -> None:
    check_depthwise(module.conv1d, type(module).__name__)  # head bounds: modes.resolve_modes (mixers='heads' only)


def gdn(project: Callable, finish: Callable) -> Callable:
    """An adapter from the family's own projections (`project` → mixed_qkv pre-conv, beta, a,
    gate) and output path (`finish(core_out, gate)` → output)."""

    def make(module: Any, bind: MixerBinding) -> Callable:
        from transformers.activations import ACT2FN

        core = importlib.import_module(type(module).__module__).torch_chunk_gated_delta_rule
        act = ACT2FN[module.activation]

        def forward(hidden_states, cache_params=None, attention_mask=None, **kwargs):
            lay = bind.layout(module, hidden_states)
            mixed_qkv, beta, a, gate = project(module, hidden_states)
            out = gdn_core(module, bind, lay, mixed_qkv, beta, a, act, core)  # [B, S_local, H_v, D_v]
            return finish(module, out, gate)

        return forward

    return make


def qwen3_next_project(m, h):
    query, key, value, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(h), m.in_proj_ba(h))
    mixed = torch.cat([t.reshape(t.shape[0], t.shape[1], -1) for t in (query, key, value)], dim=-1)  # [B, S_local, conv_dim]
    return mixed, b.sigmoid(), a, z  # z [B, S_local, H_v, D_v]


def qwen3_5_project(m, h):
    z = m.in_proj_z(h).reshape(h.shape[0], h.shape[1], -1, m.head_v_dim)  # [B, S_local, H_v, D_v]
    return m.in_proj_qkv(h), m.in_proj_b(h).sigmoid(), m.in_proj_a(h), z


def olmo_project(m, h):
    mixed = torch.cat([m.q_proj(h), m.k_proj(h), m.v_proj(h)], dim=-1)  # [B, S_local, conv_dim]
    beta = m.b_proj(h).sigmoid()
    if m.allow_neg_eigval:
        beta = beta * 2.0
    return mixed, beta, m.a_proj(h), m.g_proj(h)


def norm_out(norm: str, proj: str) -> Callable:
    def finish(m, out, gate):
        b, s = out.shape[:2]
        y = getattr(m, norm)(out.reshape(-1, m.head_v_dim), gate.reshape(-1, m.head_v_dim))  # [B·S_local·H_v, D_v]
        return getattr(m, proj)(y.reshape(b, s, -1))

    return finish


# ---- Mamba-2: Bamba, Granite-4 hybrid, Falcon-H1, Nemotron-H, Zamba2 -------------------------


def check_mamba2(module: Any, mesh: SPMesh) -> None:
    if module.n_groups < 1 or module.num_heads % module.n_groups:
        raise ValueError(f"Mamba-2 needs its heads ({module.num_heads}) to be a multiple of n_groups ({module.n_groups})")
    check_depthwise(module.conv1d, type(module).__name__)
    inner = module.num_heads * module.head_dim
    if module.intermediate_size != inner:
        raise ValueError(f"intermediate_size {module.intermediate_size} != heads {module.num_heads} × head_dim {module.head_dim}")


def mamba2(module: Any, bind: MixerBinding) -> Callable:
    from transformers.activations import ACT2FN

    scan = importlib.import_module(type(module).__module__).mamba2_chunk_scan
    act = ACT2FN[module.activation]
    falcon = hasattr(module, "ssm_in_multiplier")  # Falcon-H1: µP multipliers around in_proj, optional norm

    def forward(hidden_states, cache_params=None, attention_mask=None, **kwargs):
        lay = bind.layout(module, hidden_states)
        dtype = hidden_states.dtype
        if falcon:
            projected = module.in_proj(hidden_states * module.ssm_in_multiplier) * module.mup_vector
        else:
            projected = module.in_proj(hidden_states)  # [B, S_local, I + conv_dim + H]
        gate, xbc, dt = projected.split([module.intermediate_size, module.conv_dim, module.num_heads], dim=-1)
        y = mamba2_core(module, bind, lay, xbc, dt, act, scan)  # [B, S_local, I] fp32
        if falcon and not module.mamba_rms_norm:
            y = y * torch.nn.functional.silu(gate)
        else:
            y = module.norm(y, gate)  # gated RMSNorm, groups spanning heads: after the exchange back
        return module.out_proj(y.to(dtype))

    return forward


# ---- RG-LRU: RecurrentGemma ------------------------------------------------------------------


def recurrent_block(module: Any, bind: MixerBinding) -> Callable:
    sqrt_bound = importlib.import_module(type(module).__module__).SqrtBoundDerivative
    lru = module.rg_lru

    def gates(x: torch.Tensor, reset: torch.Tensor):
        """transformers' RecurrentGemmaRglru.forward up to the scan, with `reset` from OUR metadata."""
        b, s, w = x.shape
        act = x.reshape(b * s, lru.num_attention_heads, lru.block_width).permute(1, 0, 2)  # [heads, B·S_local, bw]
        res = torch.baddbmm(lru.input_gate_bias[:, None, :], act, lru.input_gate_weight)
        input_gate = torch.sigmoid(res.transpose(0, 1).reshape(b, s, w))
        res = torch.baddbmm(lru.recurrent_gate_bias[:, None, :], act, lru.recurrent_gate_weight)
        recurrent_gate = torch.sigmoid(res.transpose(0, 1).reshape(b, s, w))
        log_a = -8.0 * recurrent_gate * torch.nn.functional.softplus(lru.recurrent_param)
        a, a_square = torch.exp(log_a), torch.exp(2 * log_a)
        multiplier = sqrt_bound.apply(1 - a_square)
        multiplier = reset + ~reset * multiplier
        return (x * input_gate) * multiplier.type(x.dtype), a * ~reset  # normalized x, a (0 at document starts)

    def forward(input_states, position_ids=None, attention_mask=None, use_cache=None, **kwargs):
        lay = bind.layout(module, input_states)
        y = module.act_fn(module.linear_y(input_states))  # [B, S_local, W]
        x = module.linear_x(input_states)
        x = halo_conv(x, lay, module.conv_1d.weight.squeeze(1), module.conv_1d.bias, bind.rank, bind.group).to(x.dtype)
        rank = bind.rank
        starts = lay.on_device(("doc_starts", rank), x.device, lambda: lay.doc_start[lay.indices[rank]] == lay.indices[rank])
        reset = starts[None, :, None]  # [1, S_local, 1]: document starts
        normalized, a = gates(x, reset)
        h = rglru_scan_sequence_parallel(normalized, a, lay, bind.rank, bind.group).to(x.dtype)  # [B, S_local, W]
        return module.linear_out(h * y), None

    return forward


def check_recurrent_block(module: Any, mesh: SPMesh) -> None:
    check_depthwise(module.conv_1d, type(module).__name__)
