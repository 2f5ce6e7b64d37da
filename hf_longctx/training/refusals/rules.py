"""The form of every refusal table: `Rule` (how a setting is honoured, or which values are
refused and what to do instead), the table-driven checks over a config dataclass, and the
message of one refused value.

Where it sits: under the tables of `refusals/` (TrainingArguments, Trainer parameters, TRL's
SFT / DPO / GRPO configs); the trainers' construction runs them on every rank alike, before
any collective.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Rule:
    kind: str  # "trainer" | "ours" | "mapped" | "refused"
    note: str
    ok: Callable[[Any], bool] | None = None  # refused: which values are accepted
    instead: str = ""
    show: Callable[[Any], str] | None = None  # how a refused value is named (default: `shown`)


def trainer_rule(note: str = "the Trainer's own code path, not overridden") -> Rule:
    return Rule("trainer", note)


def refused_rule(ok: Callable[[Any], bool], note: str, instead: str, show: Callable[[Any], str] | None = None) -> Rule:
    return Rule("refused", note, ok, instead, show)


def falsy(v: Any) -> bool:
    return not v


def equals(value: Any) -> Callable[[Any], bool]:
    return lambda v: v == value


def field_defaults(cls: type) -> dict[str, Any]:
    """{field: default} of a dataclass (TrainingArguments / a TRL config)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def shown(value: Any) -> str:
    """A value as a refusal shows it: its repr, or `<Type>` for an object whose repr would bury
    the message (a model) or says nothing (a function, an optimizer instance)."""
    text = repr(value)
    if isinstance(value, (bool, int, float, str, type(None))) or (len(text) <= 300 and " at 0x" not in text):
        return text
    return f"<{type(value).__name__}>"


def refusal_message(name: str, value: Any, rule: Rule, *, parameter: bool = False) -> str:
    """The one form of a refusal line: the name and value, why, and what to do instead; a
    constructor `parameter` reads "name is not supported (name=value): ..."."""
    text = rule.show(value) if rule.show is not None else shown(value)
    head = f"{name} is not supported ({name}={text})" if parameter else f"{name}={text}"
    return f"{head}: {rule.note}; do instead: {rule.instead}"


def refused_config_fields(args: Any, config_cls: type, table: dict[str, Rule]) -> list[str]:
    """The refused values of the fields a TRL config class (`SFTConfig`, `GRPOConfig`, ...) adds
    to `TrainingArguments`, by `table`; a field missing from it is refused when it differs from
    its default (a newer TRL's field is never dropped unseen)."""
    from transformers import TrainingArguments

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    defaults = field_defaults(config_cls)
    label = config_cls.__name__
    errors = []
    for f in dataclasses.fields(config_cls):
        if f.name in base:
            continue
        value, rule = getattr(args, f.name, None), table.get(f.name)
        if rule is None:
            if f.name in defaults and value != defaults[f.name]:
                errors.append(f"{label}.{f.name}={value!r}: not classified by hf_longctx (newer TRL?); do instead: "
                              "leave it at its default and report it")
        elif rule.kind == "refused" and not rule.ok(value):
            errors.append(f"{label}." + refusal_message(f.name, value, rule))
    return errors


def refused_trl_fields(args: Any, config_name: str, table: dict[str, Rule]) -> list[str]:
    """`refused_config_fields` of `args` when it is TRL's `config_name` (e.g. "SFTConfig"); nothing
    for any other arguments, or without TRL installed."""
    try:
        import trl
    except ImportError:
        return []
    config_cls = getattr(trl, config_name)
    return refused_config_fields(args, config_cls, table) if isinstance(args, config_cls) else []
