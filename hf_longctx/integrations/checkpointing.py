"""Offloaded activation checkpointing of decoder layers (FPDT §4 "OC.": layer inputs in host
memory, one layer recomputed at a time in the backward).

Where it sits: `integrations/memory.py` turns it on for `patch(..., checkpoint=True |
"attention")`; every decoder layer runs through `offloaded_checkpoint` (transformers'
GradientCheckpointingLayer through its own hook, others through an instance `forward`).
Guarantees: layer inputs go to pinned host memory on the OUT side stream during the forward;
each recompute starts the copies of the NEXT layer's inputs (`LayerChain`), so the copy
overlaps a layer of compute; host buffers return to the pool once read. The last
`inputs_on_device=N` layers keep their inputs on the device. With "attention" each call
also opens a keep-attention region (`integrations/checkpoint_attention.py`)."""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from hf_longctx.integrations.checkpoint_attention import AttentionKeeper
from hf_longctx.integrations.undo import set_instance_attr
from hf_longctx.model_walk import decoder_layers
from hf_longctx.ops.offload import Streams, copy_in, copy_out, default_streams


class _Parked(NamedTuple):
    value: torch.Tensor  # pinned host copy (offloaded) or detached alias
    device: torch.device
    requires_grad: bool
    copied: Any  # event recorded after the device -> host copy on the OUT stream; None: no copy


def park(arg: Any, streams: Streams, keep: bool = False) -> Any:
    """What the recompute will read instead of a layer input: a pinned host copy where the
    device offloads (CUDA), a detached alias elsewhere or with `keep` (a layer whose input
    stays on the device: `patch(..., inputs_on_device=N)`).

    The copy is of the DETACHED input (no autograd node), issued on the OUT stream after
    the kernels that produced the input, so it overlaps the layer's forward on the compute
    stream (`ops/offload.copy_out`); an event marks the copy's end for the read back."""
    if not isinstance(arg, torch.Tensor):
        return arg
    src = arg.detach()
    if keep or not streams.offloads(src.device):
        return _Parked(src, src.device, arg.requires_grad, None)
    (host,), copied = copy_out(streams, [src])
    return _Parked(host, src.device, arg.requires_grad, copied)


def keeps_input(index: int, layers: int, inputs_on_device: int) -> bool:
    """Whether decoder layer `index` of `layers` keeps its input on the device: the last
    `inputs_on_device` do (`patch(..., inputs_on_device=N)`)."""
    return index >= layers - inputs_on_device


def _unpark(parked: Any, streams: Streams, fetched: tuple | None = None) -> Any:
    """The recompute's copy of one input: the prefetched device copy (`fetched`: the result of
    `copy_in`) or a copy made now. The host buffer goes back to the pool right after the read
    is queued (its next writer waits for the read's event): a layer's host copy is free for the
    offloads of the backward as soon as its recompute has started."""
    if not isinstance(parked, _Parked):
        return parked
    host, device, requires_grad, copied = parked
    if copied is None:
        value = host
    else:
        (value,), ready = fetched if fetched is not None else copy_in(streams, [host], device)
        streams.current(device).wait_event(ready)  # the copy back has landed
        streams.recycle(host)
    # A leaf with the input's value: the recompute must record (and save) the same tensors
    # as the original forward, which needs requires_grad to match; gradients flow through
    # the ORIGINAL graph, whose saved tensors the recompute only refills.
    return value.detach().requires_grad_(requires_grad)


class Inputs:
    """One checkpointed call's inputs: the live ones (original forward), then the parked ones
    (recompute); `previous` is the call before it in forward order -- the layer recomputed
    NEXT in the backward, whose parked inputs this call's recompute prefetches."""

    def __init__(self, args: list, parked: list, previous: "Inputs | None") -> None:
        self.box, self.parked, self.previous = list(args), parked, previous
        self.fetched: dict[int, tuple] = {}  # index -> copy_in's (device copies, event) once prefetched
        self.recycled = False  # the host copies went back to the pool (a recompute read them)

    def prefetch(self, streams: Streams) -> None:
        """Start the host -> device copies of the parked inputs on the IN stream."""
        for i, p in enumerate(self.parked):
            if isinstance(p, _Parked) and p.copied is not None and i not in self.fetched and not self.recycled:
                self.fetched[i] = copy_in(streams, [p.value], p.device)

    def read(self, streams: Streams) -> list:
        if self.recycled:
            raise RuntimeError(
                "offloaded checkpointing hands a layer's pinned host inputs back to the pool in its first backward, so "
                "its graph cannot be run backward twice (retain_graph=True); patch without checkpointing (memory='off' "
                "or 'balanced') for a second backward through the same graph"
            )
        values = [_unpark(a, streams, self.fetched.pop(i, None)) if isinstance(a, _Parked) else a
                  for i, a in enumerate(self.box)]
        self.recycled = any(isinstance(a, _Parked) and a.copied is not None for a in self.box)
        return values


class LayerChain:
    """The checkpointed calls of one forward, in order (per patched model): each recompute
    prefetches the inputs of the layer the backward recomputes next."""

    def __init__(self) -> None:
        self.last: Inputs | None = None


def offloaded_checkpoint(
    function: Callable, *args: Any, streams: Streams | None = None, keeper: AttentionKeeper | None = None,
    chain: LayerChain | None = None, first: bool = False, split: Any = None, keep: bool = False,
) -> Any:
    """Non-reentrant activation checkpointing of `function(*args)` whose recompute reads the
    inputs from host memory (FPDT's "OC." setting).

    Why not `torch.autograd.graph.save_on_cpu(pin_memory=True)` around
    `torch.utils.checkpoint` (checked against torch 2.13): the non-reentrant checkpoint keeps
    its inputs referenced from its recompute closure, out of reach of saved-tensor hooks, so
    save_on_cpu would copy only what the checkpoint already discards and leave the inputs on
    the device; and save_on_cpu copies on the compute stream. The reentrant checkpoint breaks
    `torch.autograd.grad` and needs inputs that require grad. Here the inputs sit in a box the
    recompute reads: the host copies start (OUT stream, `park`) before the original forward
    runs on the real inputs, then the box switches to the host copies. Where the device does
    not offload (CPU) the box holds detached aliases: same structure, no copy. `streams`:
    the stream operations (the process's `ops/offload.default_streams()` by default; tests
    pass a fake). `keeper`: checkpoint="attention" -- the layer's attention calls keep their
    saved tensors and output in the original forward and are replayed in the recompute
    (`integrations/checkpoint_attention.py`). `chain` / `first`: the model's `LayerChain` and
    whether this is the forward's first checkpointed layer; the recompute of a layer then
    starts the host -> device copies of the inputs of the layer recomputed after it. `split`:
    the patch's `LayerSplit`, told while the original forward runs (`discarding`) when its saved
    tensors are all dropped (no keeper), so the attention keeps nothing for a backward. `keep`:
    the inputs stay on the device (`park`).
    """
    streams = default_streams() if streams is None else streams
    parked = [park(a, streams, keep) for a in args]  # copies start now and overlap the forward
    inputs = Inputs(list(args), parked, None if chain is None or first else chain.last)
    if chain is not None:
        chain.last = inputs
    region = keeper.new_region() if keeper is not None else None
    runs = [0]  # 0: the original forward is next; then recomputes

    def run(_anchor: torch.Tensor) -> Any:
        recompute = runs[0] > 0
        runs[0] += 1
        values = inputs.read(streams)
        if recompute:
            if inputs.previous is not None:  # the backward recomputes that layer next: overlap its copy
                inputs.previous.prefetch(streams)
                inputs.previous = None
            if chain is not None and chain.last is inputs:
                chain.last = None  # nothing of this step stays referenced after its backward
        if region is None:
            if split is None or recompute:
                return function(*values)
            split.discarding = True
            try:
                return function(*values)
            finally:
                split.discarding = False
        with keeper.entered(region, recompute=recompute):
            return function(*values)

    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    anchor = tensors[0].new_empty(0) if tensors else torch.empty(0)  # tells checkpoint the device (RNG state)
    out = torch_checkpoint(run, anchor, use_reentrant=False)
    inputs.box[:] = parked  # from now on only the recompute reads the inputs
    return out


def patch_checkpointing(
    model: nn.Module, undo: list, streams: Streams | None = None, keeper: AttentionKeeper | None = None, split: Any = None,
    inputs_on_device: int = 0,
) -> None:
    """Checkpoint every decoder layer of `model` with `offloaded_checkpoint` (instance
    attributes; `undo` gets their restores). The last `inputs_on_device` layers keep their
    inputs on the device."""
    # One side stream per device for the whole model, not one per layer call.
    streams = default_streams() if streams is None else streams
    chain = LayerChain()
    layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        offload = functools.partial(offloaded_checkpoint, streams=streams, keeper=keeper, chain=chain, first=index == 0,
                                    split=split, keep=keeps_input(index, len(layers), inputs_on_device))
        if hasattr(type(layer), "gradient_checkpointing"):  # transformers' GradientCheckpointingLayer
            set_instance_attr(layer, "gradient_checkpointing", True, undo)
            set_instance_attr(layer, "_gradient_checkpointing_func", offload, undo)
            continue
        forward = layer.forward

        def checkpointed(*args, _forward=forward, _layer=layer, **kwargs):
            if not (_layer.training and torch.is_grad_enabled()):
                return _forward(*args, **kwargs)
            return offload(functools.partial(_forward, **kwargs), *args)

        set_instance_attr(layer, "forward", checkpointed, undo)
