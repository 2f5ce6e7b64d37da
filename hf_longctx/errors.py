"""The one exception every refusal raises: `NotSupported`.

Where it sits: below everything (it imports nothing from the package). A refusal is what
`patch()`, the collator, the planner or the Trainer raise BEFORE any collective when what a
user asked for cannot run exactly under sequence parallelism (DESIGN.md, "exact or refused").
It subclasses `ValueError`, so `except ValueError` keeps catching it, and its message always
ends with a "Do instead:" line, so the user learns the way forward, not only the obstacle.
"""

from __future__ import annotations

# The way forward when a model cannot be made exact under SP at all (a constant, not state).
NO_SP = (
    "train this model without sequence parallelism (init_sequence_parallel(ulysses_degree=1, ring_degree=1): "
    "data parallel + FSDP2 only, with memory='max' to reach longer documents), or pick a supported model; "
    "hf_longctx.verify(model, mesh) reports which layers are exact"
)


class NotSupported(ValueError):
    """What was asked cannot run exactly here; the message is `what`, then "Do instead:" and
    `instead`.

    Args:
        what: The obstacle, naming the offending values.
        instead: What to do instead (a setting, another API, or running without SP).

    Raises:
        TypeError: `instead` is empty.
    """

    def __init__(self, what: str, instead: str):
        if not instead.strip():
            raise TypeError("NotSupported needs a non-empty 'instead' (what the user should do)")
        self.what = what
        self.instead = instead
        super().__init__(f"{what}\nDo instead: {instead}")

    def __reduce__(self):  # picklable across worker processes (two positional arguments, not one message)
        return (type(self), (self.what, self.instead))
