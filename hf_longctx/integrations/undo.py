"""Instance attributes that `patch()` sets and `unpatch()` puts back exactly.

Where it sits: used by every part of `patch()` that replaces something on a module instance
(the memory features' MLP / LM-head forwards and checkpoint hooks, the linear-mixer
wrappers): the class is never touched, so other instances and other models stay as they
were, and the undo restores the instance's own previous value (or its absence).
"""

from __future__ import annotations

from typing import Any, Callable

_MISSING = object()


def set_instance_attr(module: Any, name: str, value: Any, undo: list[Callable[[], None]]) -> None:
    """Set an instance attribute and append to `undo` how to put the previous state back."""
    previous = module.__dict__.get(name, _MISSING)

    def restore() -> None:
        if previous is _MISSING:
            module.__dict__.pop(name, None)
        else:
            module.__dict__[name] = previous

    undo.append(restore)
    setattr(module, name, value)
