"""`patch()` / `unpatch()`: route a Hugging Face causal LM's attention through USP / FPDT.

Where it sits: between the user's `from_pretrained` model and `ops/usp.py` (USP §3-4) or
`ops/fpdt.py` (FPDT §3). `patch()` registers an attention function under a name unique to
the call with transformers' `AttentionInterface` and switches every config to it; mesh and
options live in its closure (`integrations/attention.py`), no module globals; `unpatch()`
removes the registration and restores every config exactly.
Guarantees: HF's local-length mask is never built (the attention reads the global metadata
`SP_METADATA_KEY`); `use_cache=True` is refused; nothing approximated runs (refusals at
`patch()` name the setting to change); every forward checks that every attention layer went
through our function and that the SP group was fed the same batch (invariant 3). Why not
`AttentionMaskInterface`: docs/DESIGN.md "Integration facts about the pinned libraries"."""

from __future__ import annotations

import inspect
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hf_longctx.config import CHECKPOINT_ATTENTION, PatchOptions
from hf_longctx.data.sharding import SP_METADATA_KEY, SPBatchInfo
from hf_longctx.flex.bank import GroupBank
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.integrations.attention import (  # noqa: F401  (the kwargs tables are re-exported)
    IGNORED_ATTENTION_KWARGS, USED_ATTENTION_KWARGS, batch_mesh, make_attention, make_mask_function,
    mask_implied_window, refuse_padding,
)
from hf_longctx.errors import NotSupported
from hf_longctx.integrations.exactness import NO_SP, SUPPORTED
from hf_longctx.integrations.exactness import refuse_inexact as _refuse
from hf_longctx.model_walk import configs as _configs
from hf_longctx.model_walk import hf_model

_STATE_ATTR = "_hf_longctx_patch"  # instance attribute of the patched PreTrainedModel


@dataclass
class _PatchState:
    """Everything one `patch()` call changed, so that `unpatch()` can undo exactly that."""

    name: str
    mesh: SPMesh
    options: PatchOptions
    # What patch() was given: a GroupBank, or an SPMesh (a bank of its one group size); each
    # batch names its group in it (SPBatchInfo.group). `mesh` is its patch_mesh.
    bank: SPMesh | GroupBank
    explicit: frozenset = frozenset()  # the knobs the last patch() call was given by name (not from a preset)
    saved_impls: list = field(default_factory=list)  # [(config, original _attn_implementation_internal)]
    hooks: list = field(default_factory=list)
    memory_undo: Callable[[], None] | None = None
    probe: Any = None  # the ProbeReport of patch()'s dry run (None under unsafe_skip_exactness_check)
    mixers: Any = None  # integrations/mixers/binding.MixerBinding of the wrapped linear mixers, or None
    mixers_option: Any = None  # patch(mixers=...) as given (re-patches pass it on)
    calls: int = 0  # attention calls in the current forward
    # The sliding window a model applies through its masks alone (PhiMoE: every mask carries
    # the same window, the attention gets none; HF's sdpa/eager paths apply it through the
    # mask), read from the dry run's masks; without a dry run (unsafe_skip_exactness_check)
    # from the masks of each forward (`mask_windows`, one frozenset per mask built).
    mask_window: int | None = None
    mask_windows: list = field(default_factory=list)
    # Ring plans of the current batch, keyed by boundaries (so a stale entry is never wrong):
    # every layer of a micro-batch shares one plan instead of re-planning per layer.
    plan_cache: dict = field(default_factory=dict)
    checked: bool = False  # the first micro-batch's consistency check ran (later ones keep the host free)
    keeper: Any = None  # integrations/keep_attention.AttentionKeeper under checkpoint="attention", else None
    vision: Any = None  # integrations/vision/families adapter of an image-text-to-text model, else None
    split: Any = None  # integrations/layer_split.LayerSplit under checkpoint=True, else None


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


def _consistency_check(info: SPBatchInfo, num_items, s_local: int, device, mesh: SPMesh, *, first: bool) -> None:
    """All SP ranks must hold shards of the SAME batch (invariant 3). One tiny all_gather per
    micro-batch; every rank sees the same gathered rows, so all raise together (no hang).
    `first` (the first micro-batch of this patch) or a CPU table: the table is read on the
    host and the error names every rank's values. Later micro-batches on a GPU never block
    the host: the comparison stays on the device and `torch._assert_async` raises from there
    (a device-side assert, reported at the next synchronisation)."""
    import torch.distributed as dist

    cu_hash = 0
    for i, c in enumerate(info.cu_seqlens):
        cu_hash = (cu_hash * 1_000_003 + c * (i + 1)) % 2_147_483_647
    from hf_longctx.distributed.loss import collective_device
    from hf_longctx.devices import upload

    # The batch's device when it is a GPU one; else the group's (NCCL refuses CPU tensors).
    device = collective_device(mesh.sp_group, device)
    on_device = isinstance(num_items, torch.Tensor) and num_items.device.type != "cpu"  # int() would sync
    n = -1 if num_items is None or on_device else int(num_items)
    sig = upload(torch.tensor([info.fingerprint, cu_hash, n, s_local, info.rows], dtype=torch.long), device)  # [5]
    if on_device:
        sig[2] = num_items.to(device=device, dtype=torch.long).reshape(())  # a device copy, no host read
    rows = [torch.empty_like(sig) for _ in range(mesh.sp)]
    dist.all_gather(rows, sig, group=mesh.sp_group)  # [SP] x [5]
    table = torch.stack(rows)  # [SP, 5]
    why = (
        "the ranks of one SP group hold shards of DIFFERENT batches (per-rank [fingerprint, boundaries, "
        "num_items_in_batch, S_local, B] = {}); every rank of an SP group must call shard_batch on the same batch -- "
        "seed the sampler by DP rank, not by global rank"
    )
    if not first and table.device.type != "cpu":  # on CPU reading the table costs no device sync
        torch._assert_async((table == table[0]).all(), why.format("not read, to keep the host free"))
        return
    table = table.cpu()
    if not bool((table == table[0]).all()):
        raise ValueError(why.format(table.tolist()))


def _takes_use_cache(hf) -> bool:
    """Whether `use_cache=False` can be passed to `hf`'s forward: a parameter of its own, or its
    **kwargs reach an inner model that takes it (image-text-to-text wrappers: the language model
    otherwise defaults to `config.use_cache` and fills a DynamicCache in training)."""
    from transformers import PreTrainedModel

    params = inspect.signature(hf.forward).parameters
    if "use_cache" in params:
        return True
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return False
    return any("use_cache" in inspect.signature(m.forward).parameters
               for m in hf.modules() if m is not hf and isinstance(m, PreTrainedModel))


def _pre_forward(state: _PatchState, hf) -> Callable:
    accepts_cache = _takes_use_cache(hf)
    names = list(inspect.signature(hf.forward).parameters)
    mask_at = names.index("attention_mask") if "attention_mask" in names else None  # passed by position too

    def hook(module, args, kwargs):
        if kwargs.get("use_cache") or kwargs.get("past_key_values") is not None:
            raise ValueError(
                "a sequence-parallel forward cannot use a KV cache (use_cache=True / past_key_values); pass "
                "use_cache=False, and call hf_longctx.unpatch(model) before generate()"
            )
        if kwargs.get("output_attentions"):
            raise ValueError("output_attentions=True is not supported under sequence parallelism")
        if kwargs.get("output_router_logits"):
            raise ValueError(
                "output_router_logits=True under sequence parallelism: the MoE load-balancing loss would be computed per "
                "shard and differ from the single-device one; pass output_router_logits=False"
            )
        if accepts_cache:
            kwargs["use_cache"] = False
        mask = kwargs.get("attention_mask")
        if mask is None and mask_at is not None and len(args) > mask_at:
            mask = args[mask_at]
        refuse_padding(mask, read=not state.checked)
        info = kwargs.get(SP_METADATA_KEY)
        if not isinstance(info, SPBatchInfo):
            raise ValueError(
                f"the patched model needs the '{SP_METADATA_KEY}' entry of hf_longctx.shard_batch(batch, mesh): call "
                "model(**shard_batch(batch, mesh)); for plain single-device use call hf_longctx.unpatch(model) first"
            )
        ids = kwargs.get("input_ids", args[0] if args else None)
        ref = ids if ids is not None else kwargs.get("inputs_embeds")
        if ref is None:
            raise ValueError("the patched model needs input_ids or inputs_embeds")
        mesh = batch_mesh(state, info)  # the batch's own group (a GroupBank patch), else the patch-time mesh
        if mesh.sp > 1:
            _consistency_check(info, kwargs.get("num_items_in_batch"), ref.shape[1], ref.device, mesh, first=not state.checked)
            state.checked = True
        state.calls = 0
        state.mask_windows.clear()  # filled by the mask function as the model builds this forward's masks
        if state.mixers is not None:
            state.mixers.begin(info)  # the linear-mixer wrappers read the batch layout from here
        state.plan_cache.clear()  # bounds it to one batch; entries are keyed, so a recompute is only a miss
        return args, kwargs

    return torch.compiler.disable(hook)  # checks and a collective per batch: never traced by torch.compile


def _post_forward(state: _PatchState) -> Callable:
    def hook(module, args, kwargs, output):
        if state.probe is not None and state.calls != state.probe.attention_calls:
            raise RuntimeError(
                f"this forward made {state.calls} sequence-parallel attention calls, but the dry run at patch() made "
                f"{state.probe.attention_calls}: the model takes a different path at run time than on the probe (inputs it "
                "was not probed with, e.g. inputs_embeds or extra modalities), and exactness was only proven for that "
                "path; call the patched model with input_ids/labels from shard_batch only"
            )
        if state.mixers is not None:
            state.mixers.check_calls()
        return output

    return torch.compiler.disable(hook)


def check_mesh(mesh: Any) -> None:
    """The type check of the entry points that take either (`patch()`, the trainer): an SPMesh
    or a GroupBank; past it they ask both the same questions."""
    if not isinstance(mesh, (SPMesh, GroupBank)):
        raise TypeError(
            "mesh must be an SPMesh from hf_longctx.init_sequence_parallel or a GroupBank from "
            f"hf_longctx.init_group_bank, got {type(mesh).__name__}"
        )


class _Unset:
    """A knob the caller did not pass (memory= and a knob together is an error); `help(patch)`
    shows it as `unset` rather than an object address."""

    def __repr__(self) -> str:
        return "unset"


_UNSET: Any = _Unset()


def patch(
    model: Any,
    mesh: SPMesh | GroupBank,
    *,
    memory: str | None = None,
    kv_offload: bool = _UNSET,
    mlp_chunks: int | str | None = _UNSET,
    loss_chunks: int | str | None = _UNSET,
    checkpoint: bool | str = _UNSET,
    inputs_on_device: int = 0,
    mixers: str | dict | None = None,
    unsafe_skip_exactness_check: bool = False,
    before_install: Callable[[], Any] | None = None,
) -> Any:
    """Make `model` (a PreTrainedModel or a PEFT model) sequence-parallel over `mesh`; returns it.

    `memory`: "off", "balanced" (chunked LM head + loss, chunked MLP) or "max" (those plus
    checkpointing with offloaded inputs, plus K/V offload when the mesh has FPDT chunks);
    `hf-longctx plan` suggests one. The four knobs (default off) are for experts; a preset
    and a knob together are an error.
    `inputs_on_device`: with checkpointing (memory="high" / "max"), the last N decoder layers
    keep their inputs on the GPU instead of pinned host memory -- each layer's input is
    hidden x 2 bytes per token of the rank (bf16): GPU memory the preset leaves free holds
    what the host cannot; `hf-longctx plan` suggests N where host memory binds. Default 0.

    Call it on every rank. Afterwards call the model with `shard_batch(batch, mesh)`; each
    rank's `.loss` is its share (losses and parameter gradients SUM to the single-device
    ones). Idempotent: patching again with the same mesh and options does nothing; with
    different ones it re-patches. Raises (changing nothing) when SP cannot be exact.
    With a `GroupBank` (`init_group_bank`) each micro-batch runs on the SP group it was
    sharded for (`shard_batch(batch, bank.mesh(size))`); sizes come from the batch.

    Before changing anything, a local dry run (`integrations/probe/dry_run.py`, no collective)
    proves that only the attention mixes tokens and that everything the attention receives
    is applied; otherwise `patch()` raises naming the module class, its layers and the cause.
    unsafe_skip_exactness_check: skip the dry run. UNSAFE: a model whose modules mix tokens
        outside attention (Mamba, convolutions, linear attention, indexers) then trains a
        different model than the user thinks, silently. For experts and for verify() tests.
    mixers: how the linear recurrences of a hybrid model (Gated DeltaNet, Mamba-2, RG-LRU) cross
        the SP group: "heads" (head all-to-all: every rank gets the whole sequence for some heads;
        needs SP <= heads), "state" (state passing: every rank keeps all heads and its tokens; the
        ranks exchange O(heads x d_k x d_v) state maps, independent of the sequence length), or
        "auto" (None, the default: per micro-batch the cheaper by `ops/mixers/cost.choose`; "state"
        wherever SP > heads); or {mixer class name: scheme}. Short convolutions always exchange
        their K-1-row halo. `integrations/mixers/modes.py`.
    before_install: called once every check has passed and before anything is changed (the
        public `hf_longctx.patch(..., verify=True)` runs `verify()` here: `hf_longctx/patching.py`).
    """
    check_mesh(mesh)
    bank, mesh = mesh, mesh.patch_mesh  # a mesh is a bank of its one size, and its own patch mesh
    knobs = dict(kv_offload=kv_offload, mlp_chunks=mlp_chunks, loss_chunks=loss_chunks, checkpoint=checkpoint)
    options = PatchOptions.resolve(memory, {k: v for k, v in knobs.items() if v is not _UNSET}, mesh.fpdt_chunks,
                                   inputs_on_device)
    hf = hf_model(model)
    old = hf.__dict__.get(_STATE_ATTR)
    if old is not None:
        probed_alike = (old.probe is None) == bool(unsafe_skip_exactness_check)
        same = old.mesh == mesh and old.bank == bank and old.options == options and old.mixers_option == mixers
        if same and probed_alike and before_install is None:
            old.explicit = frozenset(k for k, v in knobs.items() if v is not _UNSET)
            return model  # the same patch; a re-patch with the exactness check back on runs it
        unpatch(model)
    attention_iface, mask_iface = _interfaces()
    from hf_longctx.integrations.mixers.registry import apply_mixers, plan_mixers

    # Linear mixers with a sequence-parallel wrapper (integrations/mixers/) are trusted by the
    # structural rule; refused mixer classes raise here with their reason (unless unsafe).
    mixer_plan, mixer_modes = plan_mixers(hf, mesh, skip_refused=unsafe_skip_exactness_check, option=mixers,
                                          sizes=bank.sizes)
    from hf_longctx.integrations.vision.binding import vision_binding

    vision = vision_binding(hf)  # the tower keeps its attention; its images run through the vision hook
    report = _refuse(
        hf, mesh, options, structural=not unsafe_skip_exactness_check, keep_configs=vision.keep_ids,
        used_kwargs=USED_ATTENTION_KWARGS, ignored_kwargs=IGNORED_ATTENTION_KWARGS,
        handled=frozenset(type(module) for _, module, _ in mixer_plan),
        ulysses_degrees=tuple(s.ulysses for s in bank.shapes),
    )
    if before_install is not None:
        before_install()

    state = _PatchState(
        name=f"hf_longctx_sp_{uuid.uuid4().hex[:12]}", mesh=mesh, options=options, probe=report, bank=bank,
        vision=vision.family,
        explicit=frozenset(k for k, v in knobs.items() if v is not _UNSET),
        mixers_option=mixers,
    )
    state.saved_impls = [(cfg, getattr(cfg, "_attn_implementation_internal", None)) for cfg in _configs(hf)]
    attention_iface.register(state.name, make_attention(state))
    if report is None:  # no dry run: the mask function notes each forward's windows
        mask_iface.register(state.name, make_mask_function(state))
    else:
        # HF's mask creation exits at once for a name the mask registry lacks (returning None):
        # our attention builds the real mask from global metadata anyway, and HF would first
        # scan the positions for packed documents with a bool() of a device tensor -- a host
        # sync per forward (`masking_utils.find_packed_sequence_indices`).
        state.mask_window = mask_implied_window(report.mask_windows)
    hf.__dict__[_STATE_ATTR] = state  # plain attribute: not a submodule, not in state_dict
    try:
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
        state.hooks.append(hf.register_forward_pre_hook(_pre_forward(state, hf), with_kwargs=True))
        state.hooks.append(hf.register_forward_hook(_post_forward(state), with_kwargs=True))
        state.mixers = apply_mixers(mixer_plan, mesh, lambda info: batch_mesh(state, info), mixer_modes)
        if options.uses_memory_options:
            from hf_longctx.integrations.memory import apply_memory_options

            if options.checkpoint == CHECKPOINT_ATTENTION:
                from hf_longctx.integrations.keep_attention import AttentionKeeper
                from hf_longctx.ops.offload import default_streams

                state.keeper = AttentionKeeper(default_streams())
            elif options.checkpoint:
                from hf_longctx.integrations.layer_split import LayerSplit

                state.split = LayerSplit(state)
            state.memory_undo = apply_memory_options(
                hf, mesh, kv_offload=options.kv_offload, mlp_chunks=options.mlp_chunks, loss_chunks=options.loss_chunks,
                checkpoint=options.checkpoint, keeper=state.keeper, split=state.split,
                inputs_on_device=options.inputs_on_device,
            )
    except BaseException:
        unpatch(model)
        raise
    return model


def unpatch(model: Any) -> Any:
    """Undo `patch()` exactly: memory options, hooks, every config's attention implementation,
    and both registrations. A no-op on a model that is not patched. Returns the model."""
    hf = hf_model(model)
    state = hf.__dict__.pop(_STATE_ATTR, None)
    if state is None:
        return model
    if state.memory_undo is not None:
        state.memory_undo()
    if state.mixers is not None:
        state.mixers.restore()
    for handle in state.hooks:
        handle.remove()
    for cfg, original in state.saved_impls:
        cfg._attn_implementation_internal = original
    attention_iface, mask_iface = _interfaces()
    attention_iface._global_mapping.pop(state.name, None)  # transformers has no public unregister
    mask_iface._global_mapping.pop(state.name, None)
    return model


def patch_state(model: Any) -> Any:
    """The patch of `model` (its mesh, bank, options and dry-run report: `_PatchState`), or
    None when it is not patched. Read-only for callers."""
    return hf_model(model).__dict__.get(_STATE_ATTR)


def is_patched(model: Any) -> bool:
    """True while `model` is patched."""
    return _STATE_ATTR in hf_model(model).__dict__
