"""patch(fused=True): the elementwise work of the decoder layers and of the loss as fused kernels.

Where it sits: `integrations/model_patch._install` calls `apply_fusion` before the memory
options (`integrations/memory.py`), which then wrap the fused modules: the chunked MLP and
norms of "balanced"/"high", the row-chunked layers of "max" and every recompute in a backward
run the same compiled regions as "off". Regions (torch.compile, inductor; torchtitan compiles
per block, here per token-wise region, so that no compiled region holds a collective, the SP
attention call, or a GEMM that a row-chunked backward writes into a gradient sum):
- every norm (the layer's own, its attention's q/k norms, the final one): its forward as it is;
- RoPE: the model's own `apply_rotary_pos_emb`, bound for each attention module of the patched
  model alone (`integrations/rebind.py`: no module global changes);
- every gated MLP of Llama's form: down(act(gate(x)) * up(x)) with `ops/fused.gated_product`;
- the loss: the chunked LM head's cross-entropy tail (`ops/fused.cross_entropy_tail`), or the
  model's own loss function over the whole logits when the loss is not chunked.
Each compiled function's graphs live with its code object: every layer, and every later patch,
shares them (parameters are graph inputs), nothing in them depends on the patch.
Guarantees: the math per token of the eager modules (tests/distributed/test_fused.py); every
change is an instance attribute, undone exactly, but one: torch's recompile limit is raised to
RECOMPILE_ROOM for the whole process; what is not of these forms runs unfused, named in one
warning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from types import FunctionType, MethodType
from typing import Callable

import torch
from torch import nn

from hf_longctx.integrations.memory import final_norm, is_norm
from hf_longctx.integrations.rebind import ROPE, global_read, plain_function, rebound
from hf_longctx.integrations.undo import set_instance_attr
from hf_longctx.model_walk import decoder_layers, layer_mlp
from hf_longctx.ops.fused import cross_entropy_tail, gated_product

# Graphs dynamo may keep per compiled code object. One region compiles once per grad mode, input
# rank (a norm's [B, S, H] hidden states, Qwen3's per-head [B, S, h, D]), row count 1 or more
# (a row-chunked layer learns its skippable projections on one row) and storage offset 0 or
# not (row chunks are views): up to 24 under memory="max", above torch's default of 8, past
# which dynamo runs the region eagerly. Read-only constant, not a flag.
RECOMPILE_ROOM = 64


def _llama_mlp_forward(self, x):  # the form a gated MLP's forward must have, bytecode for bytecode
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


def llama_form_mlp(mlp: nn.Module | None) -> bool:
    """A gated MLP whose class forward is Llama's `down(act(gate(x)) * up(x))`."""
    code, ref = getattr(type(mlp).forward, "__code__", None), _llama_mlp_forward.__code__
    return mlp is not None and code is not None and all(
        isinstance(getattr(mlp, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")) and (
        code.co_code, code.co_names, code.co_consts) == (ref.co_code, ref.co_names, ref.co_consts)


@dataclass
class Fusion:
    """What one `patch(fused=True)` compiled: the pure regions (`ops/fused.py`) and RoPE
    functions, each compiled once and shared by every module of the model, and per kind the
    modules fused and the classes left alone."""

    gated: Callable = field(default_factory=lambda: torch.compile(gated_product, dynamic=True))
    tail: Callable = field(default_factory=lambda: torch.compile(cross_entropy_tail, dynamic=True))
    ropes: dict = field(default_factory=dict)  # the model's RoPE function -> its compiled version
    fused: dict = field(default_factory=lambda: {"norm": 0, "rope": 0, "mlp": 0, "loss": ""})
    unfused: set = field(default_factory=set)

    def rope(self, fn: FunctionType) -> Callable:
        if fn not in self.ropes:
            self.ropes[fn] = torch.compile(fn, dynamic=True)
        return self.ropes[fn]


def _compile_norm(norm: nn.Module, fusion: Fusion, undo: list) -> None:
    """The norm's forward (its class forward, bound) compiled, as an instance attribute."""
    set_instance_attr(norm, "forward", torch.compile(norm.forward, dynamic=True), undo)
    fusion.fused["norm"] += 1


def _fuse_attention(attn: nn.Module, fusion: Fusion, undo: list) -> None:
    """Its q/k norms compiled, and its forward reading the compiled RoPE (when it calls one)."""
    for child in attn.children():
        if is_norm(child):
            _compile_norm(child, fusion, undo)
    forward = type(attn).forward
    rope = plain_function(global_read(forward, ROPE))
    if rope is None or "forward" in attn.__dict__:
        fusion.unfused.add(type(attn).__name__)
        return
    set_instance_attr(attn, "forward", MethodType(rebound(forward, ROPE, fusion.rope(rope)), attn), undo)
    fusion.fused["rope"] += 1


def _fused_mlp(mlp: nn.Module, gated: Callable) -> Callable:
    def forward(x: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., hidden]
        return mlp.down_proj(gated(mlp.act_fn, mlp.gate_proj(x), mlp.up_proj(x)))

    return forward


def apply_fusion(model: nn.Module, chunked_loss: bool, undo: list) -> Fusion:
    """Compile the fused regions of `model` (see the module docstring) in place; `chunked_loss`:
    the memory options chunk the LM head's loss (their `tail` is then `Fusion.tail`), else the
    model's loss function is compiled over the whole logits."""
    import torch._dynamo

    # process-wide (torch's own setting): raised, never lowered, and left so for later patches
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_ROOM)
    fusion = Fusion()
    for layer in decoder_layers(model):
        for child in layer.children():
            if is_norm(child):
                _compile_norm(child, fusion, undo)
            elif type(child).__name__.endswith("Attention"):
                _fuse_attention(child, fusion, undo)
        mlp = layer_mlp(layer)
        if llama_form_mlp(mlp) and "forward" not in mlp.__dict__:
            set_instance_attr(mlp, "forward", _fused_mlp(mlp, fusion.gated), undo)
            fusion.fused["mlp"] += 1
        elif mlp is not None:
            fusion.unfused.add(type(mlp).__name__)
    last = final_norm(model)
    if last is not None and is_norm(last):
        _compile_norm(last, fusion, undo)
    if chunked_loss:
        fusion.fused["loss"] = "chunked"
    elif callable(getattr(model, "loss_function", None)):
        # `loss_function` is a property whose setter stores `_loss_function` on the instance
        set_instance_attr(model, "_loss_function", torch.compile(model.loss_function, dynamic=True), undo)
        fusion.fused["loss"] = "whole"
    if fusion.unfused:
        warnings.warn(f"fused=True: {', '.join(sorted(fusion.unfused))} run unfused (not of Llama's form: an "
                      f"attention calling {ROPE}, a gated MLP down(act(gate(x)) * up(x))); exact either way",
                      stacklevel=3)
    return fusion
