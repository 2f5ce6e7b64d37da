"""One global name of a module class's forward, rebound for one instance: a copy of the function chain.

Where it sits: `integrations/fusion.py` binds each attention module's `apply_rotary_pos_emb` to
a compiled version, and `integrations/layer_split.py` (memory="max") to one that row chunks
replaying the attention skip, for the patched model only. A model family's attention forward
looks its RoPE function up in its module's globals at call time; replacing that global would
change every model of the family in the process. Here the class forward is copied through its
decorators' closures (transformers' `deprecate_kwarg`, `kernels`' `use_kernelized_func`) down
to the function that reads the name, whose globals are copied with the one name rebound; the
copy becomes the instance's forward (`integrations/undo.py` restores it).
Guarantees: the class, the module and every other instance stay as they are; the copy runs
equal code objects of its own (defaults, closures and line numbers alike; torch.compile compiles
it apart from the original); the module's other globals are read as they were at patch time (a
later monkeypatch of the family's module is not seen).
"""

from __future__ import annotations

from types import CellType, FunctionType, MethodType
from typing import Any

from torch import nn

MAX_DEPTH = 4  # decorators between a class forward and the body that reads the name
ROPE = "apply_rotary_pos_emb"  # the module-level function HF's attention forwards call


def _copy(fn: FunctionType, globals_: dict, closure: tuple | None) -> FunctionType:
    # An equal code object, not the same one: torch.compile keeps what it compiled per code
    # object, with names it installs in the globals of the frame it compiled -- code shared with
    # the original would run the original's compiled code under these globals, and miss them.
    new = FunctionType(fn.__code__.replace(), globals_, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    new.__dict__.update(fn.__dict__)  # functools.wraps' __wrapped__, deprecation marks
    return new


def _reader(fn: Any, name: str, depth: int = 0) -> tuple[list[int], FunctionType] | None:
    """(the closure-cell path from `fn` down, the function of the chain that reads global `name`)."""
    if not isinstance(fn, FunctionType):
        return None
    if name in fn.__code__.co_names and name in fn.__globals__:
        return [], fn
    if depth >= MAX_DEPTH:
        return None
    for i, cell in enumerate(fn.__closure__ or ()):
        try:
            found = _reader(cell.cell_contents, name, depth + 1)
        except ValueError:  # an empty cell
            continue
        if found is not None:
            return [i, *found[0]], found[1]
    return None


def global_read(fn: Any, name: str) -> Any:
    """The value of the global `name` that `fn` (or a function its decorators wrap) reads, or
    None when none of them reads it."""
    found = _reader(fn, name)
    return None if found is None else found[1].__globals__[name]


def forward_reading(module: Any, name: str) -> FunctionType | None:
    """The function behind `module`'s forward -- its class forward, or the one an instance
    forward bound to it runs (an earlier rebinding) -- when its chain reads global `name`;
    None otherwise (also for an instance forward of another kind)."""
    forward = module.__dict__.get("forward")
    if forward is None:
        fn = getattr(type(module), "forward", None)
    elif isinstance(forward, MethodType) and forward.__self__ is module:
        fn = forward.__func__
    else:
        return None
    return fn if _reader(fn, name) is not None else None


def plain_function(fn: Any) -> FunctionType | None:
    """The Python function behind `fn`: itself, or the one a `kernels` hub wrapper (an nn.Module
    holding it in its forward's closure) calls."""
    if isinstance(fn, FunctionType):
        return fn
    forward = getattr(type(fn), "forward", None) if isinstance(fn, nn.Module) else None
    for cell in getattr(forward, "__closure__", None) or ():
        inner = cell.cell_contents
        if isinstance(inner, FunctionType) and inner.__name__ == ROPE:
            return inner
    return None


def rebound(fn: FunctionType, name: str, value: Any) -> FunctionType:
    """A copy of `fn` whose chain reads `value` for the global `name` (see the module docstring).
    Raises ValueError when no function of the chain reads `name`."""
    found = _reader(fn, name)
    if found is None:
        raise ValueError(f"{getattr(fn, '__qualname__', fn)!r} reads no global {name!r} within {MAX_DEPTH} decorators")
    path, reader = found
    chain = [fn]
    for i in path:
        chain.append(chain[-1].__closure__[i].cell_contents)
    new = _copy(reader, {**reader.__globals__, name: value}, reader.__closure__)
    for outer, i in zip(reversed(chain[:-1]), reversed(path)):
        cells = list(outer.__closure__)
        cells[i] = CellType(new)
        new = _copy(outer, outer.__globals__, tuple(cells))
    return new
