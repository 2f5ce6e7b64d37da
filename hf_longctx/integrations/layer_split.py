"""Sequence-chunked decoder layers: memory="max" in O(chunk) working memory (FPDT §3.3-3.5, "OC.").

Where it sits: `integrations/memory.py` routes every decoder layer of the "max" preset
through `LayerSplit.call`; the attention function asks the patch's `LayerSplit` what to do
at each call. A layer is token-wise except for its attention call, so it runs on row
chunks split there: pre(rows) stops at the attention with the chunk's q, k, v
(`AtAttention`), post(rows, a) runs with the attention answering `a`. The backward is
`integrations/layer_run.py` (its pass through pre skips the projection GEMMs whose outputs no
backward reads: `integrations/unread_outputs.py`). Guarantees: on the device only the layer input, the gradient
through the layer, the next layer's prefetched input and O(chunk); parameter gradients
summed in fp32 and returned like any input's (FSDP2's hooks see them). A layer that cannot
be cut (dropout, a linear mixer, unknown per-token arguments) runs the plain offloaded
checkpoint with a warning. Schedule: docs/DESIGN.md "The per-token memory budget"."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import nn

from hf_longctx.integrations.checkpointing import LayerChain, offloaded_checkpoint
from hf_longctx.integrations.layer_rows import cut_dim
from hf_longctx.integrations.layer_run import LayerRun
from hf_longctx.integrations.patch_state import PatchState
from hf_longctx.ops.grad_sums import SumsSlot
from hf_longctx.ops.offload import default_streams
from hf_longctx.ops.tiling import mlp_chunks_at


class AtAttention(BaseException):
    """Raised by the attention in a pre-attention run: the layer stops at its attention call
    (a BaseException, so no `except Exception` in model code swallows it)."""


class LayerSplit:
    """Per patch: the mode the attention function runs in, and the layers' entry point."""

    def __init__(self, state: PatchState) -> None:
        self.state = state  # the patch binding (its attention-call counter)
        self.mode: str | None = None  # None | "capture" | "replay"
        self.captured: tuple | None = None
        self.output: torch.Tensor | None = None
        self.replays = 0
        self.discarding = False  # a checkpoint's first run (offloaded_checkpoint): saved tensors are dropped
        self.chain = LayerChain()  # this forward's layers in order: each backward prefetches the one before
        self.slot = SumsSlot()  # the layer backward's gradient sums, where the projections write (ops/grad_sums.py)
        self.skippable: dict[int, frozenset] = {}  # id(layer) -> its projections `post` need not run
        self.skip: frozenset = frozenset()  # those of the layer in `post` now
        # id(layer) -> the weights of `pre`'s projections whose outputs pre's backward never reads
        # (learnt by `integrations/unread_outputs.learn_unread`): their forward GEMM is not run in that backward
        self.unread: dict[int, frozenset] = {}
        self.recorded: list | None = None  # (module id, output gradient edge) of post's projections, while learning
        self.chunks = 1  # token chunks of the layer's token-wise parts (the MLP chunks)
        self.auto = False  # the "auto" MLP chunks: no chunk below MIN_MLP_CHUNK_TOKENS rows
        self.warned: set[str] = set()
        self.runs = {"chunked": 0, "whole": 0}  # layer calls per path (tests and benchmarks read them)
        self.no_grad_runs = 0  # row-chunked layer calls without gradients (call_no_grad)

    # ---- the attention's side (integrations/attention_route.AttentionRoute) ---------------------
    def answer(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
        """In `post`, the attention output of the chunk the layer runs on; else None."""
        return self.replay() if self.replaying() else None

    def run(self, attend: Callable[[bool], torch.Tensor], prepared: Callable[[], tuple]) -> torch.Tensor:
        """In `pre`, the chunk's q, k, v are captured and the layer stops here; else the attention
        runs, keeping nothing for a backward in a checkpoint's first run (`discarding`)."""
        if self.capturing():
            self.capture(*prepared())
        return attend(not self.discarding)

    def capturing(self) -> bool:
        return self.mode == "capture"

    def replaying(self) -> bool:
        return self.mode == "replay"

    def capture(self, q, k, v, call) -> None:
        self.captured = (q, k, v, call)
        raise AtAttention

    def replay(self) -> torch.Tensor:
        self.replays += 1
        if self.replays > 1:
            raise RuntimeError("memory='max': a decoder layer called its attention twice; patch with checkpoint='attention'")
        return self.output

    # ---- running a layer on rows ---------------------------------------------------------------
    def pre(self, forward: Callable, h: torch.Tensor, kwargs: dict) -> tuple:
        """(q, k, v, AttentionCall) of the layer on the rows `h`, stopping at its attention call."""
        self.mode, self.captured = "capture", None
        try:
            forward(h, **kwargs)
        except AtAttention:
            pass
        finally:
            self.mode = None
        if self.captured is None:
            raise RuntimeError("memory='max': a decoder layer returned without calling its attention")
        captured, self.captured = self.captured, None
        return captured

    def post(self, forward: Callable, h: torch.Tensor, kwargs: dict, a: torch.Tensor, layer: nn.Module | None = None,
             recorded: list | None = None) -> torch.Tensor:
        """The layer's output on the rows `h` with attention output `a` ([B, rows, H, D_v]). The
        projections before the attention call that `skippable` names for `layer` are not run
        (`projection`); `recorded`: a list that gets (id(module), the output's gradient edge) of
        the others."""
        self.mode, self.output, self.replays = "replay", a, 0
        self.skip, self.recorded = self.skippable.get(id(layer), frozenset()), recorded
        try:
            out = forward(h, **kwargs)
        finally:
            self.mode, self.output, self.skip, self.recorded = None, None, frozenset(), None
        if self.replays != 1:
            raise RuntimeError("memory='max': a decoder layer returned without calling its attention")
        return out[0] if isinstance(out, tuple) else out

    def projection(self, module: nn.Linear, forward: Callable) -> Callable:
        """A forward for the projection `module` of a decoder layer: in `post`, before the
        attention call, a projection whose output `learn` found without a gradient path to
        the layer's output (the replayed attention ignores q, k, v) returns an uninitialised
        tensor of its output's shape instead of running its GEMM; its values reach nothing."""
        def run(x: torch.Tensor) -> torch.Tensor:
            if self.mode != "replay" or self.replays:
                return forward(x)
            if id(module) in self.skip:
                device = x.device.type
                dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
                return x.new_empty((*x.shape[:-1], module.out_features), dtype=dtype)  # [..., out]
            out = forward(x)
            if self.recorded is not None and out.requires_grad:  # its edge, not the tensor: nothing kept alive
                self.recorded.append((id(module), torch.autograd.graph.get_gradient_edge(out)))
            return out

        return run

    def learn(self, layer: nn.Module, recorded: list, grads: list) -> None:
        """From one `post` run with gradients: the projections (`recorded`) whose outputs got
        no gradient (`grads` None) are skipped in the layer's later `post` runs."""
        needed = {i for (i, _), g in zip(recorded, grads) if g is not None}
        self.skippable[id(layer)] = frozenset(i for i, _ in recorded if i not in needed)

    # ---- entry point -----------------------------------------------------------------------------
    def call(self, layer: nn.Module, forward: Callable, first: bool, args: tuple, kwargs: dict, keep: bool = False) -> Any:
        """The patched forward of a decoder layer: chunked when it can be cut, else offloaded
        checkpoint. `keep`: its input stays on the device (`checkpointing.park`)."""
        streams = default_streams()
        if first:
            self.chain.last = None
        why = _uncut(layer, args, kwargs)
        self.runs["whole" if why else "chunked"] += 1
        if why:
            if why not in self.warned:
                self.warned.add(why)
                warnings.warn(f"memory='max': {type(layer).__name__} runs whole-layer offloaded checkpointing, not "
                              f"sequence chunks ({why}); exact, with more device memory per token", stacklevel=3)
            return offloaded_checkpoint(lambda *a: forward(*a, **kwargs), *args, streams=streams, chain=self.chain,
                                        first=first, split=self, keep=keep)
        h, rest = args[0], args[1:]  # the rest: no tensors (GPT-2 passes its cache and masks, None, by position)
        params = list(dict.fromkeys(p for p in layer.parameters() if p.requires_grad))
        run = LayerRun(self, layer, lambda rows, **kw: forward(rows, *rest, **kw), kwargs, params, streams, keep)
        run.chunks = mlp_chunks_at(self.chunks, h.shape[1], self.auto)  # row chunks of the token-wise parts
        out = ChunkedLayer.apply(run, h, *params)
        self.state.calls += 1  # one attention call per layer, as the probe counted
        return out

    def call_no_grad(self, layer: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        """A decoder layer's forward without gradients (a frozen reference, evaluation): the same
        row chunks and FPDT loop as `call`, nothing parked or saved; a layer that cannot be cut
        runs whole. Its output as the layer returns it (a tensor)."""
        generation = self.state.generation
        if (generation is not None and generation.decoding) or _uncut(layer, args, kwargs):
            return forward(*args, **kwargs)  # a decode step's few rows run whole
        h, rest = args[0], args[1:]
        run = LayerRun(self, layer, lambda rows, **kw: forward(rows, *rest, **kw), kwargs, [], default_streams())
        run.chunks = mlp_chunks_at(self.chunks, h.shape[1], self.auto)
        out = run.run_forward(h, first=True, save=False)
        self.state.calls += 1
        self.no_grad_runs += 1
        return out


class ChunkedLayer(torch.autograd.Function):
    """The decoder layer as one autograd node: inputs (hidden states, *parameters)."""

    @staticmethod
    def forward(ctx, run: LayerRun, h: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.run = run
        return run.run_forward(h, first=run.split.chain.last is None)

    @staticmethod
    def backward(ctx, dh_out: torch.Tensor):
        run = ctx.run
        if run is None:
            raise RuntimeError("memory='max': a decoder layer's graph was run backward twice (retain_graph=True); "
                               "patch without checkpointing for a second backward through the same graph")
        ctx.run = None
        dh, grads = run.run_backward(dh_out, ctx.needs_input_grad[2:])
        return (None, dh, *grads)


def _uncut(layer: nn.Module, args: tuple, kwargs: dict) -> str:
    """Why this layer call cannot be cut into row chunks ("" when it can)."""
    from hf_longctx.integrations.mixers.registry import class_key, sp_handled_classes

    if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() != 3:
        return "its first positional argument is not its [B, S, hidden] hidden states"
    if any(isinstance(a, torch.Tensor) for a in args[1:]):
        return "it takes more than its hidden states as positional tensors"
    for name, m in layer.named_modules():
        if isinstance(m, nn.Dropout) and m.p > 0 and m.training:
            return f"dropout {name} (p={m.p}): a chunk's recompute would draw other masks"
    mixers = sp_handled_classes()
    if any(class_key(type(m)) in mixers for m in layer.modules()):
        return "it holds a linear mixer, which needs the whole sequence"
    s = args[0].shape[1]
    for name, value in kwargs.items():
        tensors = [value] if isinstance(value, torch.Tensor) else [
            t for t in value if isinstance(t, torch.Tensor)] if isinstance(value, (tuple, list)) else []
        if not tensors:
            continue
        if any(t.requires_grad for t in tensors):
            return f"its argument {name} requires grad"
        if cut_dim(name, tensors, s) is None:
            return f"its argument {name} of shape {[tuple(t.shape) for t in tensors]} is not known to be per token"
    return ""


