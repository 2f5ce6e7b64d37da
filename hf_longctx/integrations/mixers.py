"""The linear mixers of hybrid models under sequence parallelism: class → adapter registry.

Where it sits: `patch()` (`integrations/transformers.py`) calls `plan_mixers` before it
changes anything (refusals name the numbers), `apply_mixers` to replace the forward of
every supported mixer INSTANCE (an instance attribute, as `integrations/memory.py` does;
`unpatch()` restores it), and, from its model-level pre-forward hook, `MixerBinding.begin`
with the batch's `SPBatchInfo`: decoder layers do not forward arbitrary kwargs to every
mixer, so the wrappers read the batch metadata from the binding (closure, no global).

Each wrapper reuses the module's own projections, norms and parameters and replaces only
the sequence-mixing core by a scheme of `ops/mixers/` that is exact for packed documents
under any SP layout (zigzag ring × Ulysses, FPDT rank-ordinal chunks), taking document
boundaries and the token permutation from OUR metadata, never from transformers' kwargs
(transformers' own torch paths ignore `cu_seqlens` and leak state across documents).

`REGISTRY` is the single table of token mixers outside attention that hf_longctx knows:
an adapter (supported) or a refusal reason. `sp_handled_classes()` is the hook a
deny-by-default structural rule uses to accept models whose mixers are wrapped here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from hf_longctx.data.sharding import SPBatchInfo
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.errors import NO_SP, NotSupported
from hf_longctx.ops.mixers.conv import halo_conv
from hf_longctx.ops.mixers.gdn import GDNHeads, gdn_sequence_parallel
from hf_longctx.ops.mixers.layout import SequenceLayout
from hf_longctx.ops.mixers.mamba2 import Mamba2Heads, mamba2_sequence_parallel
from hf_longctx.ops.mixers.rglru import rglru_scan_sequence_parallel

_M = "transformers.models."
_MISSING = object()


@dataclass(frozen=True)
class MixerAdapter:
    """scheme: how the mixer is sequence-parallel; `make` builds the instance's new forward
    (None = refused, with `reason`); `check` raises ValueError for a layout it cannot serve."""

    scheme: str
    make: Callable | None = None
    check: Callable | None = None
    reason: str = ""


class MixerBinding:
    """The per-patch state the wrappers read: the mesh and the current batch's layout."""

    def __init__(self, mesh: SPMesh):
        self.mesh = mesh
        self.group = mesh.sp_group if mesh.sp > 1 else None
        self.rank = mesh.sp_rank
        self.undo: list[Callable[[], None]] = []
        self.modules = 0  # wrapped mixer instances
        self.calls = 0  # wrapped mixer calls in the current forward
        self._info: SPBatchInfo | None = None
        self._layout: SequenceLayout | None = None

    def begin(self, info: SPBatchInfo) -> None:
        """Called by the model-level pre-forward hook with this forward's batch metadata."""
        if self._layout is None or self._layout.cu_seqlens != info.cu_seqlens:
            m = self.mesh
            self._layout = SequenceLayout(tuple(info.cu_seqlens), m.ring, m.ulysses, m.fpdt_chunks)
        self._info = info
        self.calls = 0

    def layout(self, module: Any, hidden_states: torch.Tensor) -> SequenceLayout:
        if self._info is None:
            raise RuntimeError(f"{type(module).__name__} ran outside a patched model forward: no batch metadata bound")
        if hidden_states.shape[0] != self._info.rows or hidden_states.shape[1] != self._layout.local_length:
            raise ValueError(
                f"{type(module).__name__} got hidden states {tuple(hidden_states.shape)} but the batch metadata describes "
                f"B = {self._info.rows} rows of S_local = {self._layout.local_length} tokens"
            )
        self.calls += 1
        return self._layout

    def check_calls(self) -> None:
        if self.calls != self.modules:
            raise RuntimeError(f"only {self.calls} of {self.modules} wrapped linear mixers ran in this forward")

    def restore(self) -> None:
        for fn in reversed(self.undo):
            fn()
        self.undo.clear()


# ---- short convolutions: LFM2 / LFM2-MoE / LFM3 ----------------------------------------------


def _check_depthwise(conv: torch.nn.Conv1d, name: str) -> None:
    c, k = conv.in_channels, conv.kernel_size[0]
    if conv.groups != c or conv.out_channels != c or conv.padding[0] != k - 1 or conv.stride[0] != 1 or conv.dilation[0] != 1:
        raise ValueError(
            f"{name}: only causal depthwise convolutions are supported (groups = channels, padding = K-1, stride 1, "
            f"dilation 1); got channels {c}, groups {conv.groups}, kernel {k}, padding {conv.padding[0]}, "
            f"stride {conv.stride[0]}, dilation {conv.dilation[0]}"
        )


def _short_conv(module: Any, bind: MixerBinding) -> Callable:
    def forward(hidden_states, past_key_values=None, attention_mask=None, **kwargs):
        lay = bind.layout(module, hidden_states)
        bcx = module.in_proj(hidden_states)  # [B, S_local, 3·H]
        b_gate, c_gate, x = bcx.chunk(3, dim=-1)  # [B, S_local, H] each
        conv = halo_conv(b_gate * x, lay, module.conv.weight.squeeze(1), module.conv.bias, bind.rank, bind.group)
        y = c_gate * conv.to(hidden_states.dtype)  # [B, S_local, H]
        return module.out_proj(y)

    return forward


# ---- Gated DeltaNet: Qwen3-Next, Qwen3.5 (+MoE), OLMo-hybrid ---------------------------------


def _gdn_heads(module: Any, mesh: SPMesh) -> GDNHeads:
    return GDNHeads.split(module.num_k_heads, module.num_v_heads, mesh.sp)


def _check_gdn(module: Any, mesh: SPMesh) -> None:
    _gdn_heads(module, mesh)
    _check_depthwise(module.conv1d, type(module).__name__)


def _gdn(project: Callable, finish: Callable) -> Callable:
    """An adapter from the family's own projections (`project` → mixed_qkv pre-conv, beta, a,
    gate) and output path (`finish(core_out, gate)` → output)."""

    def make(module: Any, bind: MixerBinding) -> Callable:
        from transformers.activations import ACT2FN

        core = importlib.import_module(type(module).__module__).torch_chunk_gated_delta_rule
        heads, act = _gdn_heads(module, bind.mesh), ACT2FN[module.activation]

        def forward(hidden_states, cache_params=None, attention_mask=None, **kwargs):
            lay = bind.layout(module, hidden_states)
            mixed_qkv, beta, a, gate = project(module, hidden_states)
            out = gdn_sequence_parallel(
                mixed_qkv, beta, a, conv_weight=module.conv1d.weight.squeeze(1), conv_bias=module.conv1d.bias,
                activation=act, A_log=module.A_log, dt_bias=module.dt_bias, head_k_dim=module.head_k_dim,
                head_v_dim=module.head_v_dim, heads=heads, core=core, lay=lay, rank=bind.rank, group=bind.group,
            )  # [B, S_local, H_v, D_v]
            return finish(module, out, gate)

        return forward

    return make


def _qwen3_next_project(m, h):
    query, key, value, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(h), m.in_proj_ba(h))
    mixed = torch.cat([t.reshape(t.shape[0], t.shape[1], -1) for t in (query, key, value)], dim=-1)  # [B, S_local, conv_dim]
    return mixed, b.sigmoid(), a, z  # z [B, S_local, H_v, D_v]


def _qwen3_5_project(m, h):
    z = m.in_proj_z(h).reshape(h.shape[0], h.shape[1], -1, m.head_v_dim)  # [B, S_local, H_v, D_v]
    return m.in_proj_qkv(h), m.in_proj_b(h).sigmoid(), m.in_proj_a(h), z


def _olmo_project(m, h):
    mixed = torch.cat([m.q_proj(h), m.k_proj(h), m.v_proj(h)], dim=-1)  # [B, S_local, conv_dim]
    beta = m.b_proj(h).sigmoid()
    if m.allow_neg_eigval:
        beta = beta * 2.0
    return mixed, beta, m.a_proj(h), m.g_proj(h)


def _norm_out(norm: str, proj: str) -> Callable:
    def finish(m, out, gate):
        b, s = out.shape[:2]
        y = getattr(m, norm)(out.reshape(-1, m.head_v_dim), gate.reshape(-1, m.head_v_dim))  # [B·S_local·H_v, D_v]
        return getattr(m, proj)(y.reshape(b, s, -1))

    return finish


# ---- Mamba-2: Bamba, Granite-4 hybrid, Falcon-H1, Nemotron-H, Zamba2 -------------------------


def _check_mamba2(module: Any, mesh: SPMesh) -> None:
    Mamba2Heads.split(module.num_heads, module.n_groups, mesh.sp)
    _check_depthwise(module.conv1d, type(module).__name__)
    inner = module.num_heads * module.head_dim
    if module.intermediate_size != inner:
        raise ValueError(f"intermediate_size {module.intermediate_size} != heads {module.num_heads} × head_dim {module.head_dim}")


def _mamba2(module: Any, bind: MixerBinding) -> Callable:
    from transformers.activations import ACT2FN

    scan = importlib.import_module(type(module).__module__).mamba2_chunk_scan
    heads, act = Mamba2Heads.split(module.num_heads, module.n_groups, bind.mesh.sp), ACT2FN[module.activation]
    falcon = hasattr(module, "ssm_in_multiplier")  # Falcon-H1: µP multipliers around in_proj, optional norm

    def forward(hidden_states, cache_params=None, attention_mask=None, **kwargs):
        lay = bind.layout(module, hidden_states)
        dtype = hidden_states.dtype
        if falcon:
            projected = module.in_proj(hidden_states * module.ssm_in_multiplier) * module.mup_vector
        else:
            projected = module.in_proj(hidden_states)  # [B, S_local, I + conv_dim + H]
        gate, xbc, dt = projected.split([module.intermediate_size, module.conv_dim, module.num_heads], dim=-1)
        y = mamba2_sequence_parallel(
            xbc, dt, conv_weight=module.conv1d.weight.squeeze(1), conv_bias=module.conv1d.bias, activation=act,
            A_log=module.A_log, D=module.D, dt_bias=module.dt_bias, dt_limit=tuple(module.time_step_limit),
            head_dim=module.head_dim, state=module.ssm_state_size, chunk_size=module.chunk_size, heads=heads, scan=scan,
            lay=lay, rank=bind.rank, group=bind.group,
        )  # [B, S_local, I] fp32
        if falcon and not module.mamba_rms_norm:
            y = y * torch.nn.functional.silu(gate)
        else:
            y = module.norm(y, gate)  # gated RMSNorm, groups spanning heads: after the exchange back
        return module.out_proj(y.to(dtype))

    return forward


# ---- RG-LRU: RecurrentGemma ------------------------------------------------------------------


def _recurrent_block(module: Any, bind: MixerBinding) -> Callable:
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
        idx = lay.indices[bind.rank]
        reset = (lay.doc_start[idx] == idx).to(x.device)[None, :, None]  # [1, S_local, 1]: document starts
        normalized, a = gates(x, reset)
        h = rglru_scan_sequence_parallel(normalized, a, lay, bind.rank, bind.group).to(x.dtype)  # [B, S_local, W]
        return module.linear_out(h * y), None

    return forward


def _check_recurrent_block(module: Any, mesh: SPMesh) -> None:
    _check_depthwise(module.conv_1d, type(module).__name__)


# ---- the registry -------------------------------------------------------------------------------

_SHORT_CONV = MixerAdapter("halo short convolution", _short_conv, lambda m, mesh: _check_depthwise(m.conv, type(m).__name__))
_GDN_QWEN35 = MixerAdapter("GDN head all-to-all", _gdn(_qwen3_5_project, _norm_out("norm", "out_proj")), _check_gdn)
_MAMBA1 = (
    "Mamba-1 (selective scan with a per-channel [d_inner, d_state] state and no head structure) is not sequence-"
    "parallel in hf_longctx: a channel all-to-all of its x/dt/B/C would move d_state-wide B/C to every rank and its "
    "state passing is not implemented; its layers would run on each shard as if it were the whole sequence"
)
_MAMBA2 = MixerAdapter("Mamba-2 head all-to-all", _mamba2, _check_mamba2)

REGISTRY: dict[str, MixerAdapter] = {
    _M + "lfm2.modeling_lfm2.Lfm2ShortConv": _SHORT_CONV,
    _M + "lfm2_moe.modeling_lfm2_moe.Lfm2MoeShortConv": _SHORT_CONV,
    _M + "lfm3.modeling_lfm3.Lfm3ShortConv": _SHORT_CONV,
    _M + "qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet": MixerAdapter(
        "GDN head all-to-all", _gdn(_qwen3_next_project, _norm_out("norm", "out_proj")), _check_gdn
    ),
    _M + "qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet": _GDN_QWEN35,
    _M + "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet": _GDN_QWEN35,
    _M + "olmo_hybrid.modeling_olmo_hybrid.OlmoHybridGatedDeltaNet": MixerAdapter(
        "GDN head all-to-all", _gdn(_olmo_project, _norm_out("o_norm", "o_proj")), _check_gdn
    ),
    _M + "jamba.modeling_jamba.JambaMambaMixer": MixerAdapter("refused", reason=_MAMBA1),
    _M + "zamba.modeling_zamba.ZambaMambaMixer": MixerAdapter("refused", reason=_MAMBA1),
    _M + "mamba.modeling_mamba.MambaMixer": MixerAdapter("refused", reason=_MAMBA1),
    _M + "falcon_mamba.modeling_falcon_mamba.FalconMambaMixer": MixerAdapter("refused", reason=_MAMBA1),
    _M + "bamba.modeling_bamba.BambaMixer": _MAMBA2,
    _M + "falcon_h1.modeling_falcon_h1.FalconH1Mixer": _MAMBA2,
    _M + "granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridMambaLayer": _MAMBA2,
    _M + "nemotron_h.modeling_nemotron_h.NemotronHMamba2Mixer": _MAMBA2,
    _M + "zamba2.modeling_zamba2.Zamba2MambaMixer": _MAMBA2,
    _M + "recurrent_gemma.modeling_recurrent_gemma.RecurrentGemmaRecurrentBlock": MixerAdapter(
        "halo conv + RG-LRU state passing", _recurrent_block, _check_recurrent_block
    ),
}


def class_key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def sp_handled_classes() -> dict[str, str]:
    """{'module.Class': scheme} of every token-mixer class a wrapper here makes exact under SP:
    the hook for a deny-by-default rule in `patch()` (match with `class_key(type(module))`)."""
    return {key: a.scheme for key, a in REGISTRY.items() if a.make is not None}


def refused_classes() -> dict[str, str]:
    """{'module.Class': reason} of the token mixers hf_longctx knows and refuses."""
    return {key: a.reason for key, a in REGISTRY.items() if a.make is None}


def mixer_modules(hf: torch.nn.Module) -> list[tuple[str, torch.nn.Module, MixerAdapter]]:
    """(name, module, adapter) of every module of `hf` whose class is in the registry."""
    return [(n, m, REGISTRY[class_key(type(m))]) for n, m in hf.named_modules() if class_key(type(m)) in REGISTRY]


def plan_mixers(
    hf: torch.nn.Module, mesh: SPMesh, *, skip_refused: bool = False
) -> list[tuple[str, torch.nn.Module, MixerAdapter]]:
    """Every registered mixer of `hf` that gets a wrapper; raises (changing nothing) for a
    refused class, a head count or kernel the layout cannot serve, or an option the wrappers
    do not support. `skip_refused` (patch's unsafe keyword) leaves refused classes unwrapped
    instead of raising: they then run on each shard as if it were the whole sequence."""
    found = mixer_modules(hf)
    problems: dict[str, str] = {}
    planned = []
    for name, module, adapter in found:
        cls = type(module).__name__
        if adapter.make is None:
            if not skip_refused:
                problems.setdefault(cls, f"{cls} ({name}): {adapter.reason}")
            continue
        planned.append((name, module, adapter))
        try:
            if adapter.check is not None:
                adapter.check(module, mesh)
        except ValueError as e:
            problems.setdefault(cls, f"{cls} ({name}): {e}")
    if problems:
        raise NotSupported(
            f"cannot patch {type(hf).__name__} for exact sequence parallelism:\n- " + "\n- ".join(problems.values()),
            "where a line above names a head count or setting, use an SP degree it divides (ulysses x ring); otherwise "
            + NO_SP,
        )
    return planned


def apply_mixers(found: list, mesh: SPMesh) -> MixerBinding | None:
    """Replace the forward of every planned mixer instance; None when the model has none."""
    if not found:
        return None
    bind = MixerBinding(mesh)
    for _, module, adapter in found:
        previous = module.__dict__.get("forward", _MISSING)

        def restore(module=module, previous=previous) -> None:
            if previous is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = previous

        bind.undo.append(restore)
        module.forward = adapter.make(module, bind)
        bind.modules += 1
    return bind
