"""`patch()` / `unpatch()`: route a Hugging Face causal LM's attention through USP / FPDT.

Where it sits: between the user's `from_pretrained` model and `ops/usp.py` (USP §3-4) or
`ops/fpdt.py` (FPDT §3). `patch()` registers an attention function under a name unique to
the call with transformers' `AttentionInterface` and switches every config to it; mesh and
options live in its closure (`integrations/attention.py`), no module globals; what it changes
on the model is installed and undone by `integrations/patch_install.py`; `unpatch()` removes
the registration and restores every config exactly.
Guarantees: HF's local-length mask is never built (the attention reads the global metadata
`SP_METADATA_KEY`); `use_cache=True` is refused; nothing approximated runs (refusals at
`patch()` name the setting to change); every forward checks that every attention layer went
through our function and that the SP group was fed the same batch (invariant 3). Why not
`AttentionMaskInterface`: docs/DESIGN.md "Integration facts about the pinned libraries"."""

from __future__ import annotations

import uuid
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from hf_longctx.config import PatchOptions
from hf_longctx.flex.bank import GroupBank
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.integrations.attention import (  # noqa: F401  (the kwargs tables are re-exported)
    IGNORED_ATTENTION_KWARGS, USED_ATTENTION_KWARGS, make_attention, make_mask_function, mask_implied_window,
)
from hf_longctx.integrations.exactness import refuse_inexact as _refuse
from hf_longctx.integrations.patch_args import UNSET, check_mesh, resolve_options
from hf_longctx.integrations.patch_install import install, uninstall
from hf_longctx.integrations.patch_state import STATE_ATTR, InstallPlan, PatchState, is_patched, patch_state  # noqa: F401  (re-exported)
from hf_longctx.model_walk import configs as _configs
from hf_longctx.model_walk import hf_model


def _interfaces():
    """transformers' two registries; raises a clear error if this release changed them."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    for cls in (AttentionInterface, AttentionMaskInterface):
        if not (callable(getattr(cls, "register", None)) and isinstance(getattr(cls, "_global_mapping", None), dict)):
            import transformers

            raise RuntimeError(
                f"transformers {transformers.__version__}: {cls.__name__} no longer has register()/_global_mapping; "
                "hf_longctx supports transformers >=5.23,<6"
            )
    return AttentionInterface, AttentionMaskInterface


def patch(
    model: Any,
    mesh: SPMesh | GroupBank,
    *,
    memory: str | None = None,
    kv_offload: bool = UNSET,
    mlp_chunks: int | str | None = UNSET,
    loss_chunks: int | str | None = UNSET,
    checkpoint: bool | str = UNSET,
    inputs_on_device: int = 0,
    keep_attention: bool = False,
    fused: bool = False,
    loss_chunk_rows: int | None = None,
    attention_backend: str | None = None,
    mixers: str | dict | None = None,
    unsafe_skip_exactness_check: bool = False,
    before_install: Callable[[], Any] | None = None,
) -> Any:
    """Make `model` (a PreTrainedModel or a PEFT model) sequence-parallel over `mesh`; returns it.

    Call it on every rank. Afterwards call the model with `shard_batch(batch, mesh)`; each
    rank's `.loss` is its share (losses and parameter gradients SUM to the single-device
    ones). Idempotent: patching again with the same mesh and options does nothing; with
    different ones it re-patches. Raises (changing nothing) when SP cannot be exact.
    With a `GroupBank` (`init_group_bank`) each micro-batch runs on the SP group it was
    sharded for (`shard_batch(batch, bank.mesh(size))`); sizes come from the batch.

    Before changing anything, a local dry run (`integrations/probe/dry_run.py`, no collective)
    proves that only the attention mixes tokens and that everything the attention receives
    is applied; otherwise `patch()` raises naming the module class, its layers and the cause.
    (Long because this docstring is the reference of every option.)

    Args:
        model: A `PreTrainedModel` or a PEFT model.
        mesh: An `SPMesh` (`init_sequence_parallel`) or a `GroupBank` (`init_group_bank`).
        memory: A preset: "off", "balanced" (chunked LM head + loss, chunked MLP), "high" (those plus checkpointing
            that keeps the attention's saved tensors) or "max" (those plus full checkpointing with offloaded inputs);
            "high" and "max" add K/V offload when the mesh has FPDT chunks. `hf-longctx plan` suggests one. A preset
            and a knob together are an error.
        kv_offload: Knob (experts; default off): FPDT offloads K/V chunks to host memory (needs
            `mesh.fpdt_chunks > 1`).
        mlp_chunks: Knob: run every MLP over this many sequence chunks (None: unchunked, "auto": FPDT's default).
        loss_chunks: Knob: compute the LM head + loss over this many sequence chunks (None: unchunked, "auto").
        checkpoint: Knob: activation checkpointing of every decoder layer: True recomputes the whole layer in the
            backward; "attention" recomputes everything but the core attention and its collectives.
        inputs_on_device: With checkpointing (memory="high" / "max"), the last N decoder layers keep their inputs on
            the GPU instead of pinned host memory -- each layer's input is hidden x 2 bytes per token of the rank
            (bf16): GPU memory the preset leaves free holds what the host cannot; `hf-longctx plan` suggests N where
            host memory binds.
        keep_attention: With memory="max", layers keep the attention's output and LSE (host memory, about a layer
            input per token) for their backward; `hf-longctx plan` says where it pays.
        fused: Norms, RoPE, the gated MLP's product and the loss's elementwise tail run as compiled, fused kernels
            under any preset or knobs (`integrations/fusion.py`).
        loss_chunk_rows: Rows per chunk of the chunked LM head (with memory="balanced" / "high" / "max" or
            loss_chunks="auto"); None: `ops/loss_rows.loss_chunk_rows`' "auto", at least 2048 rows so the head's
            GEMMs are compute-bound. `hf-longctx plan` suggests fewer where GPU memory binds.
        attention_backend: The local attention kernel every call runs: "torch_flash", "torch_flash[FA3]" /
            "[FA4]" (after the user's `torch.nn.attention.activate_flash_attention_impl`), "flash_attn", "cudnn",
            "cudnn_frontend", "aten_cpu" or "math" (`config.ATTENTION_BACKENDS`). None (the default): the fastest
            exact one measured on the GPU (`capacity/gpus.py`); a backend without a measured fraction there is never
            picked unnamed. A named one that cannot run a call raises, with the reason, before its first collective.
        mixers: How the linear recurrences of a hybrid model (Gated DeltaNet, Mamba-2, RG-LRU) cross the SP group:
            "heads" (head all-to-all: every rank gets the whole sequence for some heads; needs SP <= heads), "state"
            (state passing: every rank keeps all heads and its tokens; the ranks exchange O(heads x d_k x d_v) state
            maps, independent of the sequence length), or "auto" (None, the default: per micro-batch the cheaper by
            `ops/mixers/cost.choose`; "state" wherever SP > heads); or {mixer class name: scheme}. Short convolutions
            always exchange their K-1-row halo. `integrations/mixers/modes.py`.
        unsafe_skip_exactness_check: Skip the dry run. UNSAFE: a model whose modules mix tokens outside attention
            (Mamba, convolutions, linear attention, indexers) then trains a different model than the user thinks,
            silently. For experts and for verify() tests.
        before_install: Called once every check has passed and before anything is changed (the public
            `hf_longctx.patch(..., verify=True)` runs `verify()` here: `hf_longctx/patching.py`).

    Returns:
        `model`, patched.

    Raises:
        NotSupported: SP cannot be exact for this model or setting (the module class, its layers and the cause named);
            nothing is changed.
        ValueError: An option out of range, or a preset and a knob together.
        TypeError: An unknown option.
    """
    check_mesh(mesh)
    knobs = dict(kv_offload=kv_offload, mlp_chunks=mlp_chunks, loss_chunks=loss_chunks, checkpoint=checkpoint)
    options, explicit = resolve_options(memory, knobs, mesh.patch_mesh, inputs_on_device, keep_attention, fused=fused,
                                        loss_chunk_rows=loss_chunk_rows, attention_backend=attention_backend)
    return patch_with(model, mesh, options, explicit=explicit, mixers=mixers,
                      unsafe_skip_exactness_check=unsafe_skip_exactness_check, before_install=before_install)


def patch_with(
    model: Any,
    mesh: SPMesh | GroupBank,
    options: PatchOptions,
    *,
    explicit: frozenset = frozenset(),
    mixers: str | dict | None = None,
    unsafe_skip_exactness_check: bool = False,
    before_install: Callable[[], Any] | None = None,
) -> Any:
    """`patch()` with its options already resolved: `options` is taken whole, as validated when
    it was built (`PatchOptions.resolve` in `patch()`, or `dataclasses.replace` of a patch's own
    options by a trainer), never spread into keyword arguments or checked again; only what needs
    the mesh and the model is checked here. `explicit`: the knobs the user named (not from a
    preset). The other arguments as `patch()`'s."""
    check_mesh(mesh)
    if not isinstance(options, PatchOptions):
        raise TypeError(f"options must be a PatchOptions (hf_longctx.config), got {type(options).__name__}")
    bank, mesh = mesh, mesh.patch_mesh  # a mesh is a bank of its one size, and its own patch mesh
    hf = hf_model(model)
    old = patch_state(hf)
    if old is not None:
        if _same_patch(old, mesh, bank, options, mixers, unsafe_skip_exactness_check) and before_install is None:
            old.explicit = explicit
            return model  # the same patch; a re-patch with the exactness check back on runs it
        unpatch(model)
    attention_iface, mask_iface = _interfaces()
    mixer_plan, mixer_modes, vision, report = _check_model(hf, mesh, bank, options, mixers, unsafe_skip_exactness_check)
    if before_install is not None:
        before_install()

    state = PatchState(
        name=f"hf_longctx_sp_{uuid.uuid4().hex[:12]}", mesh=mesh, options=options, probe=report, bank=bank,
        explicit=explicit, mixers_option=mixers, install_plan=InstallPlan(vision, mixer_plan, mixer_modes),
    )
    _register(state, hf, attention_iface, mask_iface)
    try:
        install(state, hf)
    except BaseException:
        unpatch(model)
        raise
    return model


def _same_patch(old: PatchState, mesh: SPMesh, bank: SPMesh | GroupBank, options: PatchOptions, mixers, unsafe) -> bool:
    """Whether the patch `old` is the one this call asks for: the same mesh, bank, options and
    mixer option, with the dry run run (or skipped) alike."""
    probed_alike = (old.probe is None) == bool(unsafe)
    same = old.mesh == mesh and old.bank == bank and old.options == options and old.mixers_option == mixers
    return same and probed_alike


def _check_model(hf, mesh: SPMesh, bank: SPMesh | GroupBank, options: PatchOptions, mixers, unsafe: bool):
    """Every check of the model, before anything is changed: the linear mixers' plan, the
    vision binding, and `exactness.refuse_inexact` (the dry run unless `unsafe`). Returns
    (mixer plan, mixer modes, vision binding, dry-run report or None)."""
    from hf_longctx.integrations.mixers.registry import plan_mixers

    # Linear mixers with a sequence-parallel wrapper (integrations/mixers/) are trusted by the
    # structural rule; refused mixer classes raise here with their reason (unless unsafe).
    mixer_plan, mixer_modes = plan_mixers(hf, mesh, skip_refused=unsafe, option=mixers, sizes=bank.sizes)
    from hf_longctx.integrations.vision.binding import vision_binding

    vision = vision_binding(hf)  # the tower keeps its attention; its images run through the vision hook
    report = _refuse(
        hf, mesh, options, structural=not unsafe, keep_configs=vision.keep_ids,
        used_kwargs=USED_ATTENTION_KWARGS, ignored_kwargs=IGNORED_ATTENTION_KWARGS,
        handled=frozenset(type(module) for _, module, _ in mixer_plan),
        ulysses_degrees=tuple(s.ulysses for s in bank.shapes),
    )
    return mixer_plan, mixer_modes, vision, report


def _register(state: PatchState, hf, attention_iface, mask_iface) -> None:
    """Register the attention under `state.name` (and, without a dry run, the mask function),
    note every config's attention implementation for `unpatch()`, and keep `state` on the model."""
    state.saved_impls = [(cfg, getattr(cfg, "_attn_implementation_internal", None)) for cfg in _configs(hf)]
    attention_iface.register(state.name, make_attention(state))
    if state.probe is None:  # no dry run: the mask function notes each forward's windows
        mask_iface.register(state.name, make_mask_function(state))
    else:
        # HF's mask creation exits at once for a name the mask registry lacks (returning None):
        # our attention builds the real mask from global metadata anyway, and HF would first
        # scan the positions for packed documents with a bool() of a device tensor -- a host
        # sync per forward (`masking_utils.find_packed_sequence_indices`).
        state.mask_window = mask_implied_window(state.probe.mask_windows)
    hf.__dict__[STATE_ATTR] = state  # plain attribute: not a submodule, not in state_dict


def unpatch(model: Any) -> Any:
    """Undo `patch()` exactly: memory options, hooks, every config's attention implementation,
    and both registrations. A no-op on a model that is not patched.

    Args:
        model: The patched model (or PEFT model).

    Returns:
        `model`, unpatched.
    """
    hf = hf_model(model)
    state = hf.__dict__.pop(STATE_ATTR, None)
    if state is None:
        return model
    uninstall(state)
    attention_iface, mask_iface = _interfaces()
    attention_iface._global_mapping.pop(state.name, None)  # transformers has no public unregister
    mask_iface._global_mapping.pop(state.name, None)
    return model


@contextmanager
def suspended(model: Any) -> Iterator[Any]:
    """Inside: `model` runs as the model it was before `patch()` (transformers' own attention,
    no hooks, no memory options: `generate` with its KV cache works); on exit the same patch is
    put back -- the same `PatchState`, options, dry-run report and registration, nothing
    resolved, validated or probed again. A no-op on a model that is not patched. Local: no
    collective."""
    hf = hf_model(model)
    state = patch_state(hf)
    if state is None:
        yield model
        return
    uninstall(state)  # first: if it raises, the state stays on the model for unpatch()
    del hf.__dict__[STATE_ATTR]
    try:
        yield model
    finally:
        unpatch(model)  # a patch made inside the block comes off exactly (a no-op otherwise)
        hf.__dict__[STATE_ATTR] = state
        try:
            install(state, hf)
        except BaseException:
            unpatch(model)
            raise
