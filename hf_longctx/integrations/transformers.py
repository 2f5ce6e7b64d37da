"""`patch()` / `unpatch()`: route a Hugging Face causal LM's attention through USP / FPDT.

Where it sits: between the user's `from_pretrained` model and `ops/usp.py` (USP paper
§3-4) or `ops/fpdt.py` (FPDT paper §3). `patch()` registers, under a name unique to the
call, an attention function AND a mask function with transformers' `AttentionInterface` /
`AttentionMaskInterface`, and switches the model (every config and sub-model) to that name.
The mesh and options are bound in the closure of the registered functions -- no module
globals; `unpatch()` removes both registrations and restores every config exactly.

Design invariants enforced here:
- HF's mask is built at the LOCAL shard length and knows nothing of the documents of other
  ranks, so our mask function builds nothing; the attention takes the real document layout
  from the global metadata `shard_batch` put in the batch (`SP_METADATA_KEY`, invariant 5);
- `use_cache=False` is set on every patched forward (a cache of local shards is meaningless
  and HF's cache path disables its packed-document mask) and `use_cache=True` is refused;
- nothing is approximated: attention dropout > 0, dynamic/longrope RoPE (scaled from each
  rank's local max position), non-causal attention, models whose attention bypasses the
  interface (GPT-J, GPT-Neo, Falcon in transformers 5.x) are refused at `patch()` time with
  the setting to change; at run time every forward checks that every attention layer really
  went through our function and that the SP group was fed the same batch (invariant 3).
"""

from __future__ import annotations

import inspect
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hf_longctx.config import PatchOptions
from hf_longctx.data.sharding import SP_METADATA_KEY, SPBatchInfo
from hf_longctx.distributed.group_bank import GroupBank
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.integrations.exactness import SUPPORTED
from hf_longctx.integrations.exactness import attention_modules as _attention_modules
from hf_longctx.integrations.exactness import configs as _configs
from hf_longctx.integrations.exactness import refuse_inexact as _refuse

_STATE_ATTR = "_hf_longctx_patch"  # instance attribute of the patched PreTrainedModel


@dataclass
class _PatchState:
    """Everything one `patch()` call changed, so that `unpatch()` can undo exactly that."""

    name: str
    mesh: SPMesh
    options: PatchOptions
    attention_layers: int
    bank: GroupBank | None = None  # patch(model, bank): each batch names its group (SPBatchInfo.group)
    saved_impls: list = field(default_factory=list)  # [(config, original _attn_implementation_internal)]
    hooks: list = field(default_factory=list)
    memory_undo: Callable[[], None] | None = None
    probed: bool = True  # False under unsafe_skip_exactness_check: attention_layers is then a guess
    probe: Any = None  # the ProbeReport of patch()'s dry run (None when skipped)
    mixers: Any = None  # integrations/mixers.MixerBinding of the wrapped linear mixers, or None
    calls: int = 0  # attention calls in the current forward
    # Sliding windows of each mask the model built in the current forward (one frozenset per
    # mask); a model whose masks ALL carry the same window but that does not pass it to the
    # attention (PhiMoE) gets it from here -- HF's sdpa/eager paths apply it through the mask.
    mask_windows: list = field(default_factory=list)
    # Ring plans of the current batch, keyed by boundaries (so a stale entry is never wrong):
    # every layer of a micro-batch shares one plan instead of re-planning per layer.
    plan_cache: dict = field(default_factory=dict)


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


def _hf_model(model: Any):
    """The PreTrainedModel inside `model` (itself, or the base model of a PEFT wrapper)."""
    from transformers import PreTrainedModel

    seen = model
    for _ in range(4):  # PeftModel -> LoraModel -> PreTrainedModel at most
        if isinstance(seen, PreTrainedModel):
            return seen
        if callable(getattr(type(seen), "get_base_model", None)):
            seen = seen.get_base_model()
        elif type(seen).__module__.startswith("peft") and isinstance(getattr(seen, "model", None), torch.nn.Module):
            seen = seen.model
        else:
            break
    raise TypeError(
        f"patch()/unpatch() need a transformers PreTrainedModel or a PEFT model wrapping one, got {type(model).__name__}; "
        "patch the model before wrapping it in DDP/FSDP"
    )


# Keywords `sp_attention` APPLIES (the structural rule of probe.py lets them reach it) and
# keywords it may safely ignore (with why). Any other non-None keyword a model passes to the
# attention refuses at patch(). When the attention learns a new input (e.g. `s_aux` sinks),
# move it into USED here.
USED_ATTENTION_KWARGS = frozenset({"scaling", "dropout", "sliding_window", "softcap", "s_aux", SP_METADATA_KEY})
IGNORED_ATTENTION_KWARGS = frozenset({
    "position_ids",  # the document layout comes from SP_METADATA_KEY, built from the same positions
    "cache_position", "past_key_values", "past_key_value", "use_cache", "layer_idx",  # cache only; refused at forward
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",  # flash varlen metadata: shard_batch's replaces it
    "output_attentions",  # refused at forward
    "is_causal",  # non-causal modules are refused by refuse_inexact
    "position_embeddings",  # RoPE cos/sin, already applied to q and k by the model
    "attention_type", "head_mask",
})


def batch_mesh(state: _PatchState, info: SPBatchInfo) -> SPMesh:
    """The SP group this batch was laid out for. With a group bank it comes from the batch
    (`SPBatchInfo.group`), so every layer -- and activation-checkpoint recomputation, which
    replays the same kwargs -- runs on the group the planner chose for this micro-batch."""
    if info.group is None:
        return state.mesh
    size, index = info.group
    if state.bank is None:
        if size != state.mesh.sp or index != state.mesh.dp_rank:
            raise ValueError(
                f"the batch was sharded for SP group (size {size}, index {index}) but the model was patched with a mesh "
                f"whose group is (size {state.mesh.sp}, index {state.mesh.dp_rank}); shard with the patch() mesh, or patch "
                "with a GroupBank"
            )
        return state.mesh
    mesh = state.bank.mesh(size)  # raises naming the bank's sizes if it has none of this size
    if mesh.dp_rank != index:
        raise ValueError(
            f"rank {state.bank.rank} got a batch for group {index} of size {size}, which covers ranks "
            f"[{index * size}, {(index + 1) * size}); its own group of that size is {mesh.dp_rank}"
        )
    return mesh


def _make_attention(state: _PatchState) -> Callable:
    """The function registered with AttentionInterface; `state` is this patch's binding."""
    offload = state.options.kv_offload

    def sp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        info = kwargs.get(SP_METADATA_KEY)
        if not isinstance(info, SPBatchInfo):
            raise ValueError(
                f"{type(module).__name__}: no '{SP_METADATA_KEY}' metadata reached the attention; call the patched model "
                "with the output of hf_longctx.shard_batch(batch, mesh) (model(**shard)), or unpatch() it first"
            )
        mesh = batch_mesh(state, info)
        if dropout:
            raise ValueError(f"{type(module).__name__}: attention dropout {dropout} cannot be exact under SP; load with it set to 0.0")
        if isinstance(attention_mask, torch.Tensor):
            raise ValueError(
                f"{type(module).__name__} received a materialised attention mask of shape {tuple(attention_mask.shape)}; "
                "under SP the document mask comes from shard_batch -- do not pass attention_mask"
            )
        if getattr(module, "is_causal", True) is False:
            raise NotImplementedError(f"{type(module).__name__}: non-causal attention is not supported under SP")
        window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        if window is None:
            window = mask_implied_window(state.mask_windows)
        softcap = kwargs.get("softcap")
        b = query.shape[0]
        if b != info.rows:
            raise ValueError(f"the shard's metadata describes {info.rows} rows but the attention got B = {b}")
        dtype = compute_dtype(query, key, value)
        q, k, v = (t.transpose(1, 2).to(dtype) for t in (query, key, value))  # [B, S_local, H(_kv), D]
        d_v = v.shape[-1]
        if d_v > k.shape[-1]:
            raise NotImplementedError(f"{type(module).__name__}: value head dim {d_v} > key head dim {k.shape[-1]}")
        if d_v < k.shape[-1]:  # MLA (DeepSeek): zero value columns give zero outputs, as HF's flash path pads
            v = torch.nn.functional.pad(v, (0, k.shape[-1] - d_v))  # [B, S_local, H_kv, D]
        kw = dict(
            cu_seqlens=info.cu_seqlens if b == 1 else None,  # B > 1: one document per row
            causal=True,
            softmax_scale=scaling,
            window=int(window) if window is not None else None,
            softcap=float(softcap) if softcap else None,
            sinks=kwargs.get("s_aux"),  # per-head attention sinks [H] (GPT-OSS & co.), None elsewhere
        )
        # Our kernels accumulate in fp32 themselves; autocast must not re-cast their matmuls.
        with torch.autocast(q.device.type, enabled=False):
            if mesh.fpdt_chunks > 1:
                from hf_longctx.ops.fpdt import fpdt_attention

                out = fpdt_attention(q, k, v, mesh, offload=offload, **kw)  # [B, S_local, H, D]
            else:
                from hf_longctx.ops.usp import usp_attention

                out = usp_attention(q, k, v, mesh, plan_cache=state.plan_cache, **kw)  # [B, S_local, H, D]
        state.calls += 1
        if out.shape[-1] != d_v:
            out = out[..., :d_v].contiguous()  # [B, S_local, H, D_v]
        return out, None

    return sp_attention


def compute_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.dtype:
    """The one dtype q, k and v are brought to before sequence-parallel attention.

    Under autocast HF's rotary embedding hands fp32 q/k next to a bf16 v; HF's own
    flash-attention integration (`integrations/flash_attention.get_target_dtype`) then runs
    attention in the autocast dtype, and so do we. Without autocast the inputs already agree
    (fp32 weights, or weights loaded in bf16). fp16 is refused: its range needs loss scaling
    and the ring/FPDT merges are verified for fp32 and bf16 only.
    """
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type) and query.dtype == torch.float32:
        dtype = torch.get_autocast_dtype(device_type)
    elif query.dtype == key.dtype == value.dtype:
        dtype = query.dtype
    else:
        raise ValueError(
            f"attention inputs of different dtypes outside autocast: q {query.dtype}, k {key.dtype}, v {value.dtype}; "
            "load the model in one dtype or train under torch.autocast"
        )
    if dtype == torch.float16:
        raise ValueError(
            "fp16 attention is not supported by hf_longctx (its range needs loss scaling and the ring/FPDT merges are "
            "verified for fp32 and bf16 only); use bf16: Accelerate mixed_precision='bf16', TrainingArguments(bf16=True), "
            "or from_pretrained(..., dtype=torch.bfloat16)"
        )
    return dtype


def mask_implied_window(mask_windows: list) -> int | None:
    """The sliding window every mask of this forward carries (all masks built with the same
    single window), else None: with masks of several kinds (full and sliding layers) the
    attention must receive its layer's window itself (the structural rule checks it does)."""
    kinds = set(mask_windows)
    if len(kinds) == 1:
        (only,) = kinds
        if len(only) == 1:
            return next(iter(only))
    return None


def _make_mask_function(state: _PatchState) -> Callable:
    def sp_mask(attention_mask=None, mask_function=None, **_: Any):
        """Registered with AttentionMaskInterface. HF calls it with LOCAL lengths; the real
        document mask is built inside the attention, so build nothing -- only note the mask's
        sliding window (`state.mask_windows`). A 2D padding mask with zeros cannot be honoured
        (its keys live on other ranks): refuse instead of dropping it."""
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and not bool(attention_mask.all()):
            raise ValueError(
                "attention_mask with padding zeros was passed to a sequence-parallel model; pass the padded batch "
                "through hf_longctx.shard_batch (it pads with separate documents) and drop attention_mask"
            )
        if mask_function is not None:
            from hf_longctx.integrations.probe import mask_windows

            state.mask_windows.append(frozenset(mask_windows(mask_function)))
        return None

    return sp_mask


def _consistency_check(info: SPBatchInfo, num_items, s_local: int, device, mesh: SPMesh) -> None:
    """All SP ranks must hold shards of the SAME batch (invariant 3). One tiny all_gather;
    every rank sees the same gathered rows, so all raise together (no hang)."""
    import torch.distributed as dist

    cu_hash = 0
    for i, c in enumerate(info.cu_seqlens):
        cu_hash = (cu_hash * 1_000_003 + c * (i + 1)) % 2_147_483_647
    from hf_longctx.loss import collective_device

    n = -1 if num_items is None else int(num_items)
    # The batch's device when it is a GPU one; else the group's (NCCL refuses CPU tensors).
    device = collective_device(mesh.sp_group, device)
    sig = torch.tensor([info.fingerprint, cu_hash, n, s_local, info.rows], dtype=torch.long, device=device)  # [5]
    rows = [torch.empty_like(sig) for _ in range(mesh.sp)]
    dist.all_gather(rows, sig, group=mesh.sp_group)  # [SP] x [5]
    table = torch.stack(rows).cpu()  # [SP, 5]
    if not bool((table == table[0]).all()):
        raise ValueError(
            "the ranks of one SP group hold shards of DIFFERENT batches (per-rank [fingerprint, boundaries, "
            f"num_items_in_batch, S_local, B] = {table.tolist()}); every rank of an SP group must call shard_batch "
            "on the same batch -- seed the sampler by DP rank, not by global rank"
        )


def _pre_forward(state: _PatchState, hf) -> Callable:
    accepts_cache = "use_cache" in inspect.signature(hf.forward).parameters

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
            _consistency_check(info, kwargs.get("num_items_in_batch"), ref.shape[1], ref.device, mesh)
        state.calls = 0
        state.mask_windows.clear()  # filled by the mask function as the model builds this forward's masks
        if state.mixers is not None:
            state.mixers.begin(info)  # the linear-mixer wrappers read the batch layout from here
        state.plan_cache.clear()  # bounds it to one batch; entries are keyed, so a recompute is only a miss
        return args, kwargs

    return hook


def _post_forward(state: _PatchState) -> Callable:
    def hook(module, args, kwargs, output):
        if state.probed and state.calls != state.attention_layers:
            raise RuntimeError(
                f"this forward made {state.calls} sequence-parallel attention calls, but the dry run at patch() made "
                f"{state.attention_layers}: the model takes a different path at run time than on the probe (inputs it "
                "was not probed with, e.g. inputs_embeds or extra modalities), and exactness was only proven for that "
                "path; call the patched model with input_ids/labels from shard_batch only"
            )
        if state.mixers is not None:
            state.mixers.check_calls()
        return output

    return hook


_UNSET: Any = object()  # a knob the caller did not pass (memory= and a knob together is an error)


def patch(
    model: Any,
    mesh: SPMesh | GroupBank,
    *,
    memory: str | None = None,
    kv_offload: bool = _UNSET,
    mlp_chunks: int | str | None = _UNSET,
    loss_chunks: int | str | None = _UNSET,
    checkpoint: bool = _UNSET,
    verify: bool = False,
    unsafe_skip_exactness_check: bool = False,
) -> Any:
    """Make `model` (a PreTrainedModel or a PEFT model) sequence-parallel over `mesh`; returns it.

    `memory`: "off", "balanced" (chunked LM head + loss, chunked MLP) or "max" (those plus
    checkpointing with offloaded inputs, plus K/V offload when the mesh has FPDT chunks);
    `hf-longctx plan` suggests one. The four knobs (default off) are for experts; a preset
    and a knob together are an error.

    Call it on every rank. Afterwards call the model with `shard_batch(batch, mesh)`; each
    rank's `.loss` is its share (losses and parameter gradients SUM to the single-device
    ones). Idempotent: patching again with the same mesh and options does nothing; with
    different ones it re-patches. Raises (changing nothing) when SP cannot be exact.
    With a `GroupBank` (`init_group_bank`) each micro-batch runs on the SP group it was
    sharded for (`shard_batch(batch, bank.mesh(size))`); sizes come from the batch.

    Before changing anything, a local dry run (`integrations/probe.py`, no collective)
    proves that only the attention mixes tokens and that everything the attention receives
    is applied; otherwise `patch()` raises naming the module class, its layers and the cause.
    verify: also run `hf_longctx.verify(model, mesh)` (fp32, on a copy of the first layer of
        each distinct layer class; collective over the SP group) before patching.
    unsafe_skip_exactness_check: skip the dry run. UNSAFE: a model whose modules mix tokens
        outside attention (Mamba, convolutions, linear attention, indexers) then trains a
        different model than the user thinks, silently. For experts and for verify() tests.
    """
    bank = mesh if isinstance(mesh, GroupBank) else None
    if bank is not None:
        mesh = bank.patch_mesh
    if not isinstance(mesh, SPMesh):
        raise TypeError(
            f"mesh must be an SPMesh from hf_longctx.init_sequence_parallel or a GroupBank from init_group_bank, "
            f"got {type(mesh).__name__}"
        )
    knobs = dict(kv_offload=kv_offload, mlp_chunks=mlp_chunks, loss_chunks=loss_chunks, checkpoint=checkpoint)
    options = PatchOptions.resolve(memory, {k: v for k, v in knobs.items() if v is not _UNSET}, mesh.fpdt_chunks)
    hf = _hf_model(model)
    old = hf.__dict__.get(_STATE_ATTR)
    if old is not None:
        if old.mesh == mesh and old.bank == bank and old.options == options:
            return model
        unpatch(model)
    attention_iface, mask_iface = _interfaces()
    from hf_longctx.integrations.mixers import apply_mixers, plan_mixers

    # Linear mixers with a sequence-parallel wrapper (integrations/mixers.py) are trusted by the
    # structural rule; refused mixer classes raise here with their reason (unless unsafe).
    mixer_plan = plan_mixers(hf, mesh, skip_refused=unsafe_skip_exactness_check)
    report = _refuse(
        hf, mesh, options, structural=not unsafe_skip_exactness_check,
        used_kwargs=USED_ATTENTION_KWARGS, ignored_kwargs=IGNORED_ATTENTION_KWARGS,
        handled=frozenset(type(module) for _, module, _ in mixer_plan),
    )
    if verify:
        from hf_longctx.verify import verify as _verify

        _verify(model, mesh)

    state = _PatchState(
        name=f"hf_longctx_sp_{uuid.uuid4().hex[:12]}", mesh=mesh, options=options,
        attention_layers=report.attention_calls if report is not None else len(_attention_modules(hf)),
        probed=report is not None, probe=report, bank=bank,
    )
    state.saved_impls = [(cfg, getattr(cfg, "_attn_implementation_internal", None)) for cfg in _configs(hf)]
    attention_iface.register(state.name, _make_attention(state))
    mask_iface.register(state.name, _make_mask_function(state))
    hf.__dict__[_STATE_ATTR] = state  # plain attribute: not a submodule, not in state_dict
    try:
        hf.set_attn_implementation(state.name)
        stale = [type(cfg).__name__ for cfg, _ in state.saved_impls if cfg._attn_implementation != state.name]
        if stale:
            raise NotImplementedError(
                f"transformers did not switch {', '.join(stale)} to sequence-parallel attention; "
                f"hf_longctx supports {SUPPORTED}"
            )
        state.hooks.append(hf.register_forward_pre_hook(_pre_forward(state, hf), with_kwargs=True))
        state.hooks.append(hf.register_forward_hook(_post_forward(state), with_kwargs=True))
        state.mixers = apply_mixers(mixer_plan, mesh)
        if options.uses_memory_options:
            from hf_longctx.integrations.memory import apply_memory_options

            state.memory_undo = apply_memory_options(
                hf, mesh, kv_offload=options.kv_offload, mlp_chunks=options.mlp_chunks, loss_chunks=options.loss_chunks,
                checkpoint=options.checkpoint,
            )
    except BaseException:
        unpatch(model)
        raise
    return model


def unpatch(model: Any) -> Any:
    """Undo `patch()` exactly: memory options, hooks, every config's attention implementation,
    and both registrations. A no-op on a model that is not patched. Returns the model."""
    hf = _hf_model(model)
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


def is_patched(model: Any) -> bool:
    """True while `model` is patched."""
    return _STATE_ATTR in _hf_model(model).__dict__
