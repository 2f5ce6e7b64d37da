"""Memory options of a patched HF causal LM: chunked MLP, chunked LM head + loss, offloaded checkpointing.

Where it sits: `patch()` calls `apply_memory_options` when any memory option is set, and
the returned undo in `unpatch()`. The part of FPDT (§3.5, "OC.") outside attention: every
decoder layer's MLP, norms and the final norm run in token chunks (`ops/tiling.py`); with
labels the loss comes from `chunked_causal_lm_loss` on the last hidden state (softcap, the
model's logit scaling (`integrations/logit_maps.py`) and `num_items_in_batch` honoured) and
`logits` is None; `checkpoint=True | "attention"` turns on `checkpointing.py` /
`checkpoint_attention.py`, and with chunked MLPs `layer_split.py`; `kv_offload` goes to
`fpdt_attention(offload=...)`; host offload installs `host_budget.py`.
Guarantee: every change is an instance attribute, so no module is wrapped, state_dict keys
stay the same, and the undo restores the exact previous attributes."""

from __future__ import annotations

import functools
from types import MethodType
from typing import Callable

import torch
from torch import nn

from hf_longctx.config import PatchOptions
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.model_walk import MLP_NAMES, decoder_layers, layer_mlp, mlp_attr
from hf_longctx.integrations.checkpointing import keeps_input, patch_checkpointing
from hf_longctx.integrations.logit_maps import check_plain_head, logit_maps, logit_softcap
from hf_longctx.integrations.rebind import ROPE, forward_reading
from hf_longctx.integrations.undo import set_instance_attr
from hf_longctx.integrations.checkpoint_attention import AttentionKeeper
from hf_longctx.integrations.layer_split import LayerSplit
from hf_longctx.ops.chunked_loss import chunked_causal_lm_loss
from hf_longctx.ops.grad_sums import SumsSlot, routed_linear
from hf_longctx.ops.loss_rows import config_sizes, loss_chunk_rows
from hf_longctx.ops.tiling import chunked_mlp, default_mlp_chunks, mlp_chunks_at, tokenwise_chunks

# ---- chunked MLP --------------------------------------------------------------------------


def _patch_mlps(model: nn.Module, chunks: int, undo: list, split: LayerSplit | None, auto: bool, slot: SumsSlot) -> None:
    mlps = [(n, mlp_attr(layer), layer_mlp(layer)) for n, layer in enumerate(decoder_layers(model))]
    mlps = [(n, attr, mlp) for n, attr, mlp in mlps if mlp is not None]
    if not mlps:
        raise ValueError(f"mlp_chunks: no decoder layer of {type(model).__name__} has an MLP named {' / '.join(MLP_NAMES)}")
    for n, attr, mlp in mlps:
        for name, sub in mlp.named_modules():
            if isinstance(sub, nn.Dropout) and sub.p > 0:
                raise ValueError(
                    f"mlp_chunks needs dropout-free MLPs (a recomputed chunk cannot replay dropout): layer {n} "
                    f"{attr}.{name} has p={sub.p}; set the config's MLP/residual dropout to 0"
                )
    for _, _, mlp in mlps:
        forward = mlp.forward  # bound: class forward, or an earlier instance-level patch

        def chunked_forward(hidden: torch.Tensor, *args, _forward=forward, _mlp=mlp, **kwargs) -> torch.Tensor:
            if args or kwargs or hidden.dim() != 3:  # not the plain token-wise call: leave it alone
                return _forward(hidden, *args, **kwargs)
            if split is not None and split.mode is not None:  # a row chunk of a split layer: already a chunk
                return _forward(hidden)
            return chunked_mlp(_forward, hidden, mlp_chunks_at(chunks, hidden.shape[1], auto),
                               [p for p in _mlp.parameters() if p.requires_grad], slot)

        set_instance_attr(mlp, "forward", chunked_forward, undo)


def _patch_linears(model: nn.Module, slot: SumsSlot, undo: list, split: LayerSplit | None) -> None:
    """Every plain `nn.Linear` of the decoder layers (its class forward, not one patched by
    someone else) through `ops/grad_sums.routed_linear`: inside a row-chunked backward its
    weight gradient goes into the bound fp32 sum with one GEMM per chunk; with `split` also
    through `LayerSplit.before_attention` (row-chunked layers skip the projections their replayed
    attention ignores). Other projections (Conv1D, quantised, wrapped) are summed per chunk."""
    for layer in decoder_layers(model):
        for m in layer.modules():
            if type(m).forward is nn.Linear.forward and "forward" not in m.__dict__:
                forward = routed_linear(m, slot)
                set_instance_attr(m, "forward", forward if split is None else split.before_attention(m, forward), undo)


# ---- chunked LM head + loss ---------------------------------------------------------------


def _patch_loss(model: nn.Module, loss_chunks: int | str, undo: list, tail: Callable | None, chunk_rows: int | None,
                maps: tuple) -> None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if not isinstance(head, nn.Module) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"loss_chunks needs a linear LM head; {type(model).__name__}.get_output_embeddings() is {head!r}")
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    softcap = logit_softcap(model)  # Gemma 2's final_logit_softcapping, RecurrentGemma's logits_soft_cap
    vocab, hidden_size = config_sizes(config)
    forward = model.forward

    def forward_with_chunked_loss(*args, **kwargs):
        labels, shift_labels = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
        if labels is None and shift_labels is None:
            return forward(*args, **kwargs)
        num_items = kwargs.pop("num_items_in_batch", None)
        kwargs.pop("logits_to_keep", None)  # the loss covers every token
        return_dict = kwargs.pop("return_dict", None)  # None: HF's default, a ModelOutput
        losses: list[torch.Tensor] = []

        def head_loss(hidden: torch.Tensor) -> torch.Tensor:
            # The loss is computed INSIDE the head's call: under FSDP the head is a unit of its
            # own (integrations/accelerate.py), its weight is unsharded only during this call.
            # The loss Function takes every gradient here, so backward needs no weights.
            nonlocal shift_labels
            if shift_labels is None:  # HF's convention: position t predicts labels[t + 1]
                shift_labels = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]  # [B, S]
            chunk_size = loss_chunk_rows(vocab, hidden_size, hidden.shape[0] * hidden.shape[1], loss_chunks, chunk_rows)
            losses.append(chunked_causal_lm_loss(
                hidden, head.weight, getattr(head, "bias", None), shift_labels=shift_labels,
                num_items_in_batch=num_items, chunk_size=chunk_size, final_logit_softcapping=softcap, tail=tail,
                logit_maps=maps,
            ))
            return hidden.new_empty((*hidden.shape[:-1], 0))  # [B, S, 0]: no logits; softcap ops on it are free

        set_instance_attr(head, "forward", head_loss, restore := [])
        try:
            out = forward(*args, return_dict=True, **kwargs)
        finally:
            restore[0]()
        if len(losses) != 1:
            raise RuntimeError(f"expected one LM head call in {type(model).__name__}.forward, saw {len(losses)}")
        loss = losses[0]
        fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
        out = type(out)(loss=loss, logits=None, **fields)
        return out.to_tuple() if return_dict is False else out

    set_instance_attr(model, "forward", functools.wraps(forward)(forward_with_chunked_loss), undo)


def _mlp_sizes(model: nn.Module) -> tuple:
    """(intermediate, hidden) of the text model for the "auto" MLP chunks, (None, None) if unknown."""
    from hf_longctx.data.model_dims import ModelDims

    try:
        dims = ModelDims.from_config(model.config)
    except (AttributeError, ValueError, TypeError):
        return None, None
    return dims.intermediate, dims.hidden


# ---- memory="max": row-chunked layers and final norm ------------------------------------------

FINAL_NORMS = ("norm", "final_layernorm", "ln_f", "final_norm", "norm_f")


def final_norm(model: nn.Module) -> nn.Module | None:
    """The norm the decoder applies after its last layer (a sibling of the layer list named as
    in FINAL_NORMS), or None."""
    layers = decoder_layers(model)
    parent = next((m for m in model.modules() if any(c is layers for c in m.children())), None)
    for name in FINAL_NORMS:
        norm = getattr(parent, name, None)
        if isinstance(norm, nn.Module) and not isinstance(norm, nn.ModuleList):
            return norm
    return None


def _patch_split(model: nn.Module, split: LayerSplit, chunks: int, undo: list, auto: bool, inputs_on_device: int) -> None:
    """Every decoder layer through `split.call` (integrations/layer_split.py) while training
    with gradients, through `split.call_no_grad` without them (row chunks, nothing kept); the
    last `inputs_on_device` keep their inputs on the device. Its norms and its attention's RoPE
    function go through `split.before_attention` / `split.rope_forward` (skipped in `post`)."""
    split.chunks, split.auto = chunks, auto
    layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        forward = layer.forward  # bound: class forward, or an earlier instance-level patch
        if hasattr(type(layer), "gradient_checkpointing"):  # HF's own checkpointing would run inside the chunks
            set_instance_attr(layer, "gradient_checkpointing", False, undo)
        for part in list(layer.modules())[1:]:  # what only feeds the attention: skipped in post once learnt
            if is_norm(part):
                set_instance_attr(part, "forward", split.before_attention(part, part.forward), undo)
            elif (fn := forward_reading(part, ROPE)) is not None:
                set_instance_attr(part, "forward", MethodType(split.rope_forward(fn), part), undo)

        def split_forward(*args, _forward=forward, _layer=layer, _first=index == 0,
                          _keep=keeps_input(index, len(layers), inputs_on_device), **kwargs):
            if not torch.is_grad_enabled():  # a frozen reference, evaluation: row chunks, nothing kept
                return split.call_no_grad(_layer, _forward, args, kwargs)
            if not _layer.training:
                return _forward(*args, **kwargs)
            return split.call(_layer, _forward, _first, args, kwargs, _keep)

        set_instance_attr(layer, "forward", split_forward, undo)


def is_norm(module: nn.Module) -> bool:
    """A normalisation layer (token-wise over the hidden dim): torch's, or a model's *Norm class."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or (
        type(module).__name__.endswith(("RMSNorm", "LayerNorm")) and not list(module.children()))


def _patch_norms(model: nn.Module, chunks: int, undo: list, auto: bool, split: LayerSplit | None,
                 slot: SumsSlot) -> None:
    """The final norm and every decoder layer's own norms (its direct children) over `chunks`
    row chunks (ops/tiling.tokenwise_chunks): a norm's fp32 copies exist for one chunk at a
    time, forward and backward, and only its input is saved. Inside a row-chunked layer
    (`split` running one) they run as they are: the rows are a chunk already."""
    norms = [m for layer in decoder_layers(model) for m in layer.children() if is_norm(m)]
    last = final_norm(model)
    for norm in norms + ([last] if last is not None else []):
        norm_forward = norm.forward

        def chunked_norm(hidden, *args, _forward=norm_forward, _norm=norm, **kwargs):
            if args or kwargs or not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or (
                    split is not None and split.mode is not None):
                return _forward(hidden, *args, **kwargs)
            return tokenwise_chunks(_forward, hidden, mlp_chunks_at(chunks, hidden.shape[1], auto),
                                    [p for p in _norm.parameters() if p.requires_grad], slot)

        set_instance_attr(norm, "forward", chunked_norm, undo)


def _patch_host_budget(model: nn.Module, mesh: SPMesh, setting_kw: dict, undo: list) -> None:
    """Before the first layer runs, where the device offloads: refuse a micro-batch whose host
    offloads would not fit this rank's share of the node's memory (`integrations/host_budget.py`),
    and register the pinned buffers of one longer than every earlier one (`offload.prepare_pinned`)."""
    from hf_longctx.data.model_dims import ModelDims
    from hf_longctx.integrations.host_budget import HostBudget
    from hf_longctx.ops import offload
    from hf_longctx.capacity.estimate import Setting

    try:
        dims = ModelDims.from_config(model.config)
    except (AttributeError, ValueError, TypeError):
        dims = None  # a config the planner cannot read: no budget to check against
    setting = Setting(ulysses=mesh.ulysses, ring=mesh.ring, fpdt_chunks=mesh.fpdt_chunks, **setting_kw)
    budget = HostBudget.for_patch(dims, setting, mesh.sp) if dims is not None else None

    def check(module, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.dim() == 3 and offload.default_streams().offloads(hidden.device):
            if budget is not None:
                budget.check(hidden.shape[0] * hidden.shape[1])
            if torch.is_grad_enabled():  # a training forward: its offloads take pinned buffers
                offload.prepare_pinned(hidden.device, hidden.shape[0] * hidden.shape[1])

    handle = decoder_layers(model)[0].register_forward_pre_hook(check, with_kwargs=True)
    undo.append(handle.remove)


# ---- entry point ---------------------------------------------------------------------------


def apply_memory_options(
    model: nn.Module,
    mesh: SPMesh,
    options: PatchOptions,
    *,
    keeper: AttentionKeeper | None = None,
    split: LayerSplit | None = None,
    loss_tail: Callable | None = None,
) -> Callable[[], None]:
    """Turn on `options`' memory options on `model` in place; return an undo that restores it exactly.

    `options` is the patch's `PatchOptions`, taken whole as validated when it was built; what
    needs the model and the mesh is checked here. mlp_chunks / loss_chunks: None = off, "auto" =
    the defaults (MLP: 2 x mesh.fpdt_chunks; loss: `ops/loss_rows.loss_chunk_rows`, per call, or
    `loss_chunk_rows` rows), or a number of chunks. checkpoint: False, True (recompute whole
    layers) or "attention" (recompute all but the attention, whose calls `keeper` -- the patch's
    `AttentionKeeper` -- keeps and replays). `split`: the patch's `LayerSplit` with
    checkpoint=True; with chunked MLPs too (memory="max") every layer runs in row chunks
    (integrations/layer_split.py), keeping each attention's output and LSE with keep_attention,
    and so does the final norm. inputs_on_device: the last N decoder layers keep their
    checkpointed inputs on the device instead of the host (at most the model's decoder layers).
    `loss_tail`: the chunked loss's fused tail (`integrations/fusion.Fusion.tail`), None: the
    eager ops. Everything is checked before the model is touched.
    """
    checkpoint, mlp_chunks, loss_chunks = options.checkpoint, options.mlp_chunks, options.loss_chunks
    if (checkpoint == "attention") != (keeper is not None):
        raise ValueError("checkpoint='attention' needs the patch's AttentionKeeper (keeper=), and only it")
    if split is not None and checkpoint is not True:
        raise ValueError("a LayerSplit (split=) goes with checkpoint=True only")
    if options.keep_attention and split is None:
        raise ValueError("keep_attention=True needs row-chunked layers: checkpoint=True with the patch's LayerSplit")
    options.check_mesh(mesh.fpdt_chunks)
    inputs_on_device = options.inputs_on_device
    layers = len(decoder_layers(model))
    if inputs_on_device > layers:
        raise ValueError(f"inputs_on_device must be at most the model's {layers} decoder layers, got {inputs_on_device}")
    maps = ()
    if loss_chunks is not None:  # the chunked head: x @ W.T + b (Dory's learnt scale refused), then the model's
        check_plain_head(model)  # scaling after its head (Cohere, Granite)
        maps = logit_maps(model)
    auto = mlp_chunks == "auto"
    if auto:
        mlp_chunks = default_mlp_chunks(mesh.fpdt_chunks, *_mlp_sizes(model))
    undo: list[Callable[[], None]] = []
    try:
        if mlp_chunks is not None:
            slot = split.slot if split is not None else SumsSlot()
            _patch_linears(model, slot, undo, split if checkpoint is True else None)
            _patch_mlps(model, mlp_chunks, undo, split, auto, slot)
            _patch_norms(model, mlp_chunks, undo, auto, split, slot)
        if loss_chunks is not None:
            _patch_loss(model, loss_chunks, undo, loss_tail, options.loss_chunk_rows, maps)
        if checkpoint is True and split is not None and mlp_chunks is not None:
            _patch_split(model, split, mlp_chunks, undo, auto, inputs_on_device)
        elif checkpoint:
            patch_checkpointing(model, undo, keeper=keeper, split=split, inputs_on_device=inputs_on_device)
        if checkpoint or options.kv_offload:
            _patch_host_budget(model, mesh, dict(kv_offload=options.kv_offload, checkpoint=checkpoint,
                                                 mlp_chunks=mlp_chunks or 1, loss_chunks=0 if loss_chunks else 1,
                                                 inputs_on_device=inputs_on_device,
                                                 keep_attention=options.keep_attention), undo)
    except BaseException:
        for restore in reversed(undo):
            restore()
        raise

    def restore_all() -> None:
        while undo:
            undo.pop()()

    return restore_all
