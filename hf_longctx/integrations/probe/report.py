"""What the structural rule's dry run saw (`dry_run.probe_model`): the input of
`exactness.refuse_inexact` and of the refusal messages in `integrations/refusals.py`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ProbeReport:
    """What the dry run saw; `problems` empty means the structural rule holds."""

    attention_calls: int = 0  # per forward (the runtime check compares with it)
    called: list = field(default_factory=list)  # the attention module of each call of run A
    problems: list[str] = field(default_factory=list)
    leaks: dict = field(default_factory=dict)  # class name -> [module names]
    shape_deps: dict = field(default_factory=dict)  # class name -> [module names]
    unknown_kwargs: dict = field(default_factory=dict)  # kwarg -> {attention classes}
    mask_parts: set = field(default_factory=set)  # unsupported mask-function pieces
    no_metadata: set = field(default_factory=set)  # attention classes the metadata never reached
    tensor_masks: set = field(default_factory=set)
    non_causal: set = field(default_factory=set)  # attention classes CALLED with is_causal=False
    windows_mask: set = field(default_factory=set)
    windows_attention: set = field(default_factory=set)
    mask_windows: list = field(default_factory=list)  # per mask built: its sliding windows
    heads: dict = field(default_factory=dict)  # (query heads, KV heads) -> {attention classes} of the calls
