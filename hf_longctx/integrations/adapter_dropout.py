"""Dropout inside PEFT adapters (LoRA's `lora_dropout`, and the `*_dropout` of the other tuners),
refused.

Where it sits: in `patch()`'s exactness checks (`exactness.refuse_inexact`) and at trainer
construction -- on the model handed to a trainer (its adapter may have been added after
`patch()`) and on TRL's `peft_config=`, whose adapter SFTTrainer adds inside its constructor.
Dropout draws its mask per rank on that rank's shard of the tokens (and, in a checkpointed
recompute, again), so under SP the outputs and gradients would not equal one device's
(invariant 7): the reason attention dropout is refused. PEFT keeps an adapter's dropout in a
ModuleDict named after its config field, one entry per adapter (`lora_dropout[name]` is
`nn.Dropout(p)` when the config's lora_dropout > 0, else `nn.Identity`: peft's
`tuners/lora/layer.py`, `update_layer`), so the modules are read, whatever mode the model is in
now: `from_pretrained` returns it in eval mode, and training switches the dropout on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn


def dropout_fix(field: str) -> str:
    """What to do about an adapter whose config field `field` (e.g. lora_dropout) is > 0."""
    return (
        f"create the adapter with {field}=0.0 (e.g. LoraConfig(..., {field}=0.0) for LoRA); for a saved adapter, load "
        f"its config, set config.{field} = 0.0 and pass it: PeftModel.from_pretrained(model, path, config=config, "
        "is_trainable=True)"
    )


def adapter_dropout_problems(hf: nn.Module) -> list[str]:
    """One line per (adapter, dropout field, p) of `hf`'s PEFT tuner layers whose dropout has
    p > 0, naming the field, the value, how many modules carry it (the first few by name) and
    the fix; [] without PEFT installed or without such an adapter."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # no PEFT: no adapter
        return []
    found: dict[tuple[str, str, float], list[str]] = {}
    for name, module in hf.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        for field, per_adapter in module.named_children():
            if "dropout" not in field or not isinstance(per_adapter, nn.ModuleDict):
                continue
            for adapter, layer in per_adapter.items():
                p = getattr(layer, "p", 0.0)  # nn.Identity (dropout 0) has none
                if isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0:
                    found.setdefault((field, adapter, float(p)), []).append(name)
    lines = []
    for (field, adapter, p), names in found.items():
        shown = ", ".join(names[:3]) + (f", ... ({len(names) - 3} more)" if len(names) > 3 else "")
        lines.append(
            f"PEFT adapter '{adapter}' has {field}={p} in {len(names)} module(s) ({shown}): adapter dropout draws its "
            f"masks on each rank's shard of the tokens, so outputs and gradients would differ from one device's; {dropout_fix(field)}"
        )
    return lines


def config_dropout(peft_config: Any) -> dict[str, float]:
    """The dropout fields > 0 of a PEFT config (e.g. {"lora_dropout": 0.05}); {} for None or
    anything that is not a dataclass config."""
    if peft_config is None or not dataclasses.is_dataclass(peft_config):
        return {}
    out = {}
    for f in dataclasses.fields(peft_config):
        value = getattr(peft_config, f.name, None)
        if f.name.endswith("_dropout") and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            out[f.name] = float(value)
    return out


def shown_config(peft_config: Any) -> str:
    """A PEFT config as a refusal shows it: its class with the dropout fields it sets."""
    fields = ", ".join(f"{k}={v}" for k, v in config_dropout(peft_config).items())
    return f"{type(peft_config).__name__}({fields})"

