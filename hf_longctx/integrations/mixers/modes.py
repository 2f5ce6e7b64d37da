"""Which sequence-parallel scheme each linear recurrence runs: `patch(mixers=...)` and the cost rule.

Where it sits: `registry.plan_mixers` calls `resolve_modes` at `patch()` (every refusal
names the class, its numbers and the fix); the wrappers call `MixerBinding.scheme`, which
applies `ops/mixers/cost.choose` once per micro-batch and mixer shape from the batch's
global layout, so every rank gets the same answer. Schemes: "heads" (the head all-to-all;
at least one head per rank), "state" (state passing; no head bound), "auto" (default: the
cheaper, "state" where the group exceeds the heads); RG-LRU has only "state". `mixers=` is
one scheme for every recurrence, or {class name: scheme}. Short convolutions always
exchange their K−1-row halo."""

from __future__ import annotations

from typing import Any

from hf_longctx.ops.mixers.cost import MixerDims

MODES = ("auto", "heads", "state")
_STATE_ONLY = ("RecurrentGemmaRecurrentBlock",)


def mixer_dims(module: Any) -> MixerDims | None:
    """The sizes of a wrapped GDN or Mamba-2 module (None for the other mixers)."""
    if hasattr(module, "num_v_heads"):  # Gated DeltaNet
        return MixerDims("gdn", module.num_v_heads, module.num_k_heads, module.head_k_dim, module.head_v_dim,
                         module.conv1d.kernel_size[0])
    if hasattr(module, "ssm_state_size") and hasattr(module, "n_groups"):  # Mamba-2
        return MixerDims("mamba2", module.num_heads, module.n_groups, module.ssm_state_size, module.head_dim,
                         module.conv1d.kernel_size[0])
    return None


def check_option(option: Any) -> None:
    """Type and value check of `patch(mixers=...)` alone (no model needed)."""
    if option is None or option in MODES:
        return
    if isinstance(option, dict) and all(isinstance(k, str) and v in MODES for k, v in option.items()):
        return
    raise ValueError(f"mixers must be one of {MODES} or a dict {{mixer class name: one of {MODES}}}, got {option!r}")


def resolve_modes(found: list, option: Any, sizes: tuple[int, ...]) -> tuple[dict, list[str]]:
    """({class name: scheme}, problems) for the planned mixers `found` ((name, module, adapter))
    on SP groups of `sizes` (one size, or a GroupBank's). A problem names the class and the fix;
    the caller raises them all at once."""
    check_option(option)
    recurrent = {type(m).__name__: m for _, m, _ in found if mixer_dims(m) is not None or type(m).__name__ in _STATE_ONLY}
    problems = []
    if option is not None and not recurrent:
        classes = sorted({type(m).__name__ for _, m, _ in found}) or ["none"]
        problems.append(
            f"mixers={option!r}: this model has no linear recurrence (its mixers: {', '.join(classes)}; short "
            "convolutions always exchange their halo); leave mixers unset"
        )
        return {}, problems
    per_class = option if isinstance(option, dict) else {}
    unknown = sorted(set(per_class) - set(recurrent))
    if unknown:
        problems.append(f"mixers={option!r} names {unknown}, which this model has not; its recurrences: {sorted(recurrent)}")
    modes = {}
    for cls, module in sorted(recurrent.items()):
        mode = per_class.get(cls, "auto") if isinstance(option, dict) else (option or "auto")
        dims = mixer_dims(module)
        if cls in _STATE_ONLY:
            if mode == "heads":
                problems.append(f"{cls}: mixers='heads' -- the RG-LRU has no head all-to-all here (its state is a width-W "
                                "vector passed between shards); use mixers='state' or 'auto'")
            modes[cls] = "state"
            continue
        too_many = [s for s in sizes if s > dims.heads]
        if mode == "heads" and too_many:
            what = "value heads" if dims.kind == "gdn" else "heads"
            problems.append(
                f"{cls}: mixers='heads' splits its {dims.heads} {what} over the SP group, but a group of {max(too_many)} "
                f"ranks leaves some rank without a head; use mixers='state' or 'auto' (state passing has no head "
                f"bound), or an SP group of at most {dims.heads} ranks"
            )
        modes[cls] = mode
    return modes, problems
