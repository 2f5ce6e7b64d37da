"""Sequence-chunked decoder layers: memory="max" in O(chunk) working memory (FPDT §3.3-3.5, "OC.").

Where it sits: `integrations/memory.py` routes every decoder layer of the "max" preset
through `LayerSplit.call`; the attention function asks the patch's `LayerSplit` what to do
at each call. A layer is token-wise except for its attention call, so it runs on row
chunks split there: pre(rows) stops at the attention with the chunk's q, k, v
(`AtAttention`), post(rows, a) runs with the attention answering `a`, without the parts that
only feed the attention there (learnt per layer: the input norm, the q, k, v projections, q/k
norms and RoPE under Llama's form; `before_attention`, `rope`). The backward is
`integrations/layer_run.py` (its pass through pre skips the projection GEMMs whose outputs no
backward reads: `integrations/unread_outputs.py`). Guarantees: on the device only the layer input, the gradient
through the layer, the next layer's prefetched input and O(chunk); parameter gradients
summed in fp32 and returned like any input's (FSDP2's hooks see them). A layer that cannot
be cut (dropout, a linear mixer, unknown per-token arguments) runs the plain offloaded
checkpoint with a warning. Schedule: docs/DESIGN.md "The per-token memory budget"."""

from __future__ import annotations

import warnings
from types import FunctionType
from typing import Any, Callable

import torch
from torch import nn

from hf_longctx.integrations.checkpointing import LayerChain, offloaded_checkpoint
from hf_longctx.integrations.layer_rows import cut_dim
from hf_longctx.integrations.layer_run import LayerRun
from hf_longctx.integrations.patch_state import PatchState
from hf_longctx.integrations.rebind import ROPE, global_read, plain_function, rebound
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
        # id(layer) -> {id(part) (ROPE: its RoPE calls): (dtype, last size)}: the parts before its
        # attention `post` need not run
        self.skippable: dict[int, dict] = {}
        self.rope_forwards: dict = {}  # an attention forward -> its copy calling `rope` (`rope_forward`)
        self.skip: dict = {}  # those of the layer in `post` now
        # id(layer) -> the weights of `pre`'s projections whose outputs pre's backward never reads
        # (learnt by `integrations/unread_outputs.learn_unread`): their forward GEMM is not run in that backward
        self.unread: dict[int, frozenset] = {}
        self.recorded: list | None = None  # (part id, output gradient edge, dtype, size) in post, while learning
        self.chunks = 1  # token chunks of the layer's token-wise parts (the MLP chunks)
        self.auto = False  # the "auto" MLP chunks: no chunk below MIN_MLP_CHUNK_TOKENS rows
        self.warned: set[str] = set()
        self.runs = {"chunked": 0, "whole": 0}  # layer calls per path (tests and benchmarks read them)
        self.no_grad_runs = 0  # row-chunked layer calls without gradients (call_no_grad)
        self.extra: tuple | None = None  # what `post`'s layer returned after its hidden states (Bamba: (h, None))

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
        parts before the attention call that `skippable` names for `layer` are not run
        (`before_attention`, `rope`); `recorded`: a list that gets (id(part), the output's
        gradient edge, dtype, last size) of the others."""
        self.mode, self.output, self.replays = "replay", a, 0
        self.skip, self.recorded = self.skippable.get(id(layer), {}), recorded
        try:
            out = forward(h, **kwargs)
        finally:
            self.mode, self.output, self.skip, self.recorded = None, None, {}, None
        if self.replays != 1:
            raise RuntimeError("memory='max': a decoder layer returned without calling its attention")
        if isinstance(out, tuple):
            self.extra = out[1:]
            return out[0]
        return out

    def before_attention(self, module: nn.Module, forward: Callable) -> Callable:
        """A forward for `module`, a token-wise part of a decoder layer (a projection, a norm): in
        `post`, before the attention call, a module whose output `learn` found without a
        gradient path to the layer's output (the replayed attention ignores q, k, v, so the
        input norm, the q/k norms and the q, k, v projections feed nothing there) returns an
        uninitialised tensor of its output's last size and dtype instead of running; its values
        reach nothing."""
        def run(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if self.mode != "replay" or self.replays:
                return forward(x, *args, **kwargs)
            skipped = self.skip.get(id(module))
            if skipped is not None:
                return x.new_empty((*x.shape[:-1], skipped[1]), dtype=skipped[0])  # [..., out]
            out = forward(x, *args, **kwargs)
            self._record(id(module), (out,))
            return out

        return run

    def rope_forward(self, forward: FunctionType) -> FunctionType:
        """`forward`, an attention module's forward that calls HF's RoPE function, rebound to call
        it through `rope` (`integrations/rebind.py`): one copy per function and patch, shared by
        every module that runs it."""
        if forward not in self.rope_forwards:
            self.rope_forwards[forward] = rebound(forward, ROPE, self.rope(global_read(forward, ROPE)))
        return self.rope_forwards[forward]

    def rope(self, apply: Callable) -> Callable:
        """`apply`, a RoPE function (HF's: (q, k, cos, sin) -> (q, k) rotated; CodeGen's: (x, sin,
        cos) -> x): in `post`, before the attention call, once `learn` found its outputs without a
        gradient path to the layer's output, its leading arguments come back as given
        (placeholders), as many as it returns -- learnt only where each output has the shape of
        the argument in its place. Under torch.compile the Python function behind a `kernels`
        hub wrapper runs (dynamo cannot follow the wrapper from a closure)."""
        plain = plain_function(apply) or apply

        def run(*args: Any, **kwargs: Any) -> Any:
            fn = plain if torch.compiler.is_compiling() else apply
            if self.mode != "replay" or self.replays:
                return fn(*args, **kwargs)
            skipped = self.skip.get(ROPE)
            if skipped is not None:
                return args[0] if skipped[1] == 0 else args[: skipped[1]]  # 0: one tensor, not a tuple
            out = fn(*args, **kwargs)
            outs = out if isinstance(out, tuple) else (out,)
            if all(isinstance(o, torch.Tensor) and i < len(args) and isinstance(args[i], torch.Tensor)
                   and o.shape == args[i].shape for i, o in enumerate(outs)):
                self._record(ROPE, outs, arity=len(outs) if isinstance(out, tuple) else 0)
            return out

        return run

    def _record(self, key: int | str, outputs: tuple, arity: int | None = None) -> None:
        """While `post` learns: (key, output's gradient edge, dtype, last size -- for RoPE its
        arity) of each output with a graph -- its edge, not the tensor: nothing kept alive."""
        if self.recorded is None:
            return
        for out in outputs:
            if isinstance(out, torch.Tensor) and out.requires_grad:
                size = out.shape[-1] if arity is None else arity
                self.recorded.append((key, torch.autograd.graph.get_gradient_edge(out), out.dtype, size))

    def learn(self, layer: nn.Module, recorded: list, grads: list) -> None:
        """From one `post` run with gradients: the parts (`recorded`) none of whose outputs got a
        gradient (`grads` None), and whose outputs agree in dtype and size, are skipped in the
        layer's later `post` runs."""
        needed = {r[0] for r, g in zip(recorded, grads) if g is not None}
        forms: dict = {}
        for r in recorded:
            forms.setdefault(r[0], set()).add((r[2], r[3]))
        self.skippable[id(layer)] = {k: next(iter(f)) for k, f in forms.items() if k not in needed and len(f) == 1}

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
        self.extra = None
        out = ChunkedLayer.apply(run, h, *params)
        self.state.calls += 1  # one attention call per layer, as the probe counted
        return self._as_returned(layer, out)

    def call_no_grad(self, layer: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        """A decoder layer's forward without gradients (a frozen reference, evaluation): the same
        row chunks and FPDT loop as `call`, nothing parked or saved; a layer that cannot be cut
        runs whole. Its output as the layer returns it (`_as_returned`)."""
        generation = self.state.generation
        if (generation is not None and generation.decoding) or _uncut(layer, args, kwargs):
            return forward(*args, **kwargs)  # a decode step's few rows run whole
        h, rest = args[0], args[1:]
        run = LayerRun(self, layer, lambda rows, **kw: forward(rows, *rest, **kw), kwargs, [], default_streams())
        run.chunks = mlp_chunks_at(self.chunks, h.shape[1], self.auto)
        self.extra = None
        out = run.run_forward(h, first=True, save=False)
        self.state.calls += 1
        self.no_grad_runs += 1
        return self._as_returned(layer, out)

    def _as_returned(self, layer: nn.Module, out: torch.Tensor) -> Any:
        """`out` in the form the layer returns: a tuple where it returns one (Bamba's (hidden
        states, attention weights)), its further entries those of the last chunk's run; refused
        where one is a tensor (it would be the last chunk's alone)."""
        extra, self.extra = self.extra, None
        if extra is None:
            return out
        if any(isinstance(e, torch.Tensor) for e in extra):
            raise RuntimeError(f"memory='max': {type(layer).__name__} returns tensors after its hidden states "
                               f"({[type(e).__name__ for e in extra]}), which row chunks cannot join; patch with "
                               "checkpoint='attention'")
        return (out, *extra)


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


