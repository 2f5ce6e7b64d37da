"""What a patch installs on a model and how it comes off exactly: every config switched to the
registered attention, the forward hooks, the linear mixers' wrappers, the fused regions and the
memory options.

Where it sits: `integrations/model_patch.patch_with` registers the attention under the patch's
name and calls `install` with the `PatchState` its checks built (`state.install_plan`: the
vision binding and the mixers' plan); `unpatch` calls `uninstall` and then drops the
registrations; `suspended` calls both around a block, with the same state. Guarantee:
`uninstall` restores every attribute `install` set (instance attributes and hook handles, each
with its undo), so a model patched and unpatched, or suspended and resumed, is the model it
was."""

from __future__ import annotations

from hf_longctx.config import CHECKPOINT_ATTENTION
from hf_longctx.errors import NotSupported
from hf_longctx.integrations.attention import batch_mesh
from hf_longctx.integrations.exactness import NO_SP, SUPPORTED
from hf_longctx.integrations.forward_hooks import post_forward_hook, pre_forward_hook
from hf_longctx.integrations.patch_state import PatchState


def install(state: PatchState, hf) -> None:
    """Switch every config (but a vision tower's) to the registered attention, add the forward
    hooks, wrap the linear mixers and apply the memory options, as `state.install_plan` (the
    vision binding and the mixers' plan, from `patch()`'s checks) says. The caller unpatches
    when this raises (`NotSupported` when transformers left a config on its former attention)."""
    from hf_longctx.integrations.mixers.registry import apply_mixers

    vision, mixer_plan, mixer_modes = state.install_plan  # an InstallPlan
    hf.set_attn_implementation(vision.implementation(state.name))  # a plain name for a text-only model
    stale = [
        type(cfg).__name__ for cfg, _ in state.saved_impls
        if id(cfg) not in vision.keep_ids and cfg._attn_implementation != state.name
    ]
    if stale:
        raise NotSupported(
            f"transformers did not switch {', '.join(stale)} to sequence-parallel attention; "
            f"hf_longctx supports {SUPPORTED}",
            NO_SP,
        )
    vision_hook = vision.make_hook(state, hf)
    if vision_hook is not None:  # first: it consumes the shard's vision entry before any other check
        state.hooks.append(hf.register_forward_pre_hook(vision_hook, with_kwargs=True))
    state.hooks.append(hf.register_forward_pre_hook(pre_forward_hook(state, hf), with_kwargs=True))
    state.hooks.append(hf.register_forward_hook(post_forward_hook(state), with_kwargs=True))
    state.mixers = apply_mixers(mixer_plan, state.mesh, lambda info: batch_mesh(state, info), mixer_modes)
    if state.options.fused:  # first: the memory options wrap the fused modules
        from hf_longctx.integrations.fusion import apply_fusion

        state.fusion = apply_fusion(hf, state.options.loss_chunks is not None, state.fusion_undo)
    if state.options.uses_memory_options:
        _apply_memory_options(state, hf)


def _apply_memory_options(state: PatchState, hf) -> None:
    """The memory options (`memory.py`), with what checkpointing binds per patch: an
    `AttentionKeeper` for checkpoint="attention", a `LayerSplit` for checkpoint=True -- made at
    the first install, the same ones again after `suspended` (what the split learnt stays)."""
    from hf_longctx.integrations.memory import apply_memory_options

    options = state.options
    if options.checkpoint == CHECKPOINT_ATTENTION and state.keeper is None:
        from hf_longctx.integrations.checkpoint_attention import AttentionKeeper
        from hf_longctx.ops.offload import default_streams

        state.keeper = AttentionKeeper(default_streams())
    elif options.checkpoint is True and state.split is None:
        from hf_longctx.integrations.layer_split import LayerSplit

        state.split = LayerSplit(state)
    state.memory_undo = apply_memory_options(
        hf, state.mesh, options, keeper=state.keeper, split=state.split,
        loss_tail=state.fusion.tail if state.fusion is not None else None,
    )


def uninstall(state: PatchState) -> None:
    """Undo `install` exactly: memory options, fusion, mixers, hooks and every config's
    attention implementation; the registrations, `state`'s options and plan, and its checkpoint
    bindings (keeper, split: used only through the memory options) stay."""
    if state.memory_undo is not None:
        state.memory_undo()
    while state.fusion_undo:  # after the memory options, which wrapped the fused modules
        state.fusion_undo.pop()()
    if state.mixers is not None:
        state.mixers.restore()
    for handle in state.hooks:
        handle.remove()
    for cfg, original in state.saved_impls:
        cfg._attn_implementation_internal = original
    state.hooks, state.memory_undo, state.fusion, state.mixers = [], None, None, None
