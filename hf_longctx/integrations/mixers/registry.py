"""The registry of token mixers outside attention that hf_longctx knows, and the two steps
`patch()` runs with it: `plan_mixers` (before anything changes: refusals and layout checks)
and `apply_mixers` (instance forwards replaced, undone by `unpatch()`)."""

from __future__ import annotations

import torch

from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.errors import NO_SP, NotSupported
from hf_longctx.integrations.mixers.binding import MixerAdapter, MixerBinding
from hf_longctx.integrations.mixers.modes import resolve_modes
from hf_longctx.integrations.undo import set_instance_attr
from hf_longctx.integrations.mixers.wrappers import (
    check_depthwise,
    check_gdn,
    check_mamba2,
    check_recurrent_block,
    gdn,
    mamba2,
    norm_out,
    olmo_project,
    qwen3_5_project,
    qwen3_next_project,
    recurrent_block,
    short_conv,
)

_M = "transformers.models."

_SHORT_CONV = MixerAdapter("halo short convolution", short_conv, lambda m, mesh: check_depthwise(m.conv, type(m).__name__))
_GDN_QWEN35 = MixerAdapter("GDN head all-to-all | state passing", gdn(qwen3_5_project, norm_out("norm", "out_proj")), check_gdn)
_MAMBA1 = (
    "Mamba-1 (selective scan with a per-channel [d_inner, d_state] state and no head structure) is not sequence-"
    "parallel in hf_longctx: a channel all-to-all of its x/dt/B/C would move d_state-wide B/C to every rank, and state "
    "passing would need its decay exp(Δ·A) per token, channel AND state entry to correct the outputs (d_state times its "
    "activations) or a second scan from the true state, which mamba_ssm's selective_scan_fn cannot start (it takes no "
    "initial state); its layers would run on each shard as if it were the whole sequence"
)
_MAMBA2 = MixerAdapter("Mamba-2 head all-to-all | state passing", mamba2, check_mamba2)

REGISTRY: dict[str, MixerAdapter] = {
    _M + "lfm2.modeling_lfm2.Lfm2ShortConv": _SHORT_CONV,
    _M + "lfm2_moe.modeling_lfm2_moe.Lfm2MoeShortConv": _SHORT_CONV,
    _M + "lfm3.modeling_lfm3.Lfm3ShortConv": _SHORT_CONV,
    _M + "qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet": MixerAdapter(
        "GDN head all-to-all | state passing", gdn(qwen3_next_project, norm_out("norm", "out_proj")), check_gdn
    ),
    _M + "qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet": _GDN_QWEN35,
    _M + "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet": _GDN_QWEN35,
    _M + "olmo_hybrid.modeling_olmo_hybrid.OlmoHybridGatedDeltaNet": MixerAdapter(
        "GDN head all-to-all | state passing", gdn(olmo_project, norm_out("o_norm", "o_proj")), check_gdn
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
        "halo conv + RG-LRU state passing", recurrent_block, check_recurrent_block
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
    hf: torch.nn.Module, mesh: SPMesh, *, skip_refused: bool = False, option=None, sizes: tuple[int, ...] | None = None,
) -> tuple[list[tuple[str, torch.nn.Module, MixerAdapter]], dict]:
    """(every registered mixer of `hf` that gets a wrapper, {class name: scheme} of its
    recurrences); raises (changing nothing) for a refused class, a kernel the layout cannot
    serve, or a `patch(mixers=option)` the model cannot honour on SP groups of `sizes`
    (default: the mesh's). `skip_refused` (patch's unsafe keyword) leaves refused classes
    unwrapped instead of raising: they then run on each shard as if it were the whole sequence."""
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
    modes, mode_problems = resolve_modes(planned, option, sizes or (mesh.sp,))
    for line in mode_problems:
        problems.setdefault(line, line)
    if problems:
        raise NotSupported(
            f"cannot patch {type(hf).__name__} for exact sequence parallelism:\n- " + "\n- ".join(problems.values()),
            "where a line above names a mixers= scheme, head count or setting, follow it; otherwise " + NO_SP,
        )
    return planned, modes


def apply_mixers(found: list, mesh: SPMesh, resolve=None, modes: dict | None = None) -> MixerBinding | None:
    """Replace the forward of every planned mixer instance; None when the model has none.
    `resolve(info)`: the SPMesh of a batch (a GroupBank's group); `modes`: from `plan_mixers`."""
    if not found:
        return None
    bind = MixerBinding(mesh, resolve, modes)
    for _, module, adapter in found:
        # Eager under torch.compile: the wrapper reads the batch's layout (Python, per batch) and
        # runs collectives; traced, it would be retraced for every new document layout.
        forward = torch.compiler.disable(adapter.make(module, bind))
        set_instance_attr(module, "forward", forward, bind.undo)
        bind.modules += 1
    return bind
