"""What a causal LM does to its logits between its LM head and its loss, read from its forward.

Where it sits: `integrations/memory.py` asks `logit_maps(model)` when it patches the LM head for
the chunked loss (`ops/chunked_loss.py`), which then applies the same maps to each chunk's
logits. Some families scale the head's output before the loss: Cohere multiplies by
`self.logit_scale`, Granite divides by `self.config.logits_scaling`, Falcon-H1 and HyperCLOVAX
multiply by a multiplier; a chunked loss that left them out would train on other logits. The
forward's source is read for statements `logits = <logits or self.lm_head(...)> <* or />
<self.attribute chain>`, and each chain is read off the model (Gemma 2's softcap, the chain
ending in `final_logit_softcapping`, is the loss's own argument). A map of value 1 is left out.
`check_plain_head` refuses a head that computes more than `x @ weight.T + bias` (its own forward,
or parameters beyond weight and bias: Dory's learnt per-token scale), which a chunked head would
drop with its gradient.
Guarantees: the maps in the forward's order, each the op HF runs in the logits' dtype; a config
field by which transformers' models rescale logits, set to a non-neutral value and named on a
line of the forward about the logits or the head but in no statement of that form (or a forward
without source), is refused naming it (`LogitMapError`), before the model is touched; a class's
forward is read once per process.
"""

from __future__ import annotations

import functools
import inspect
import re
from numbers import Real
from typing import Any

from torch import nn

from hf_longctx.model_walk import hf_model

# Config fields by which transformers' causal LMs rescale their logits after the LM head.
SCALE_FIELDS = ("logit_scale", "logits_scaling", "output_multiplier", "lm_head_multiplier")
_STATEMENT = re.compile(r"^\s*logits\s*=\s*(?:logits|self\.lm_head\(.*\))\s*([*/])\s*(self(?:\.[A-Za-z_]\w*)+)"
                        r"\s*(?:#.*)?$")
SOFTCAPS = ("final_logit_softcapping", "logits_soft_cap")  # tanh softcaps: the chunked loss's own argument


class LogitMapError(ValueError):
    """A logit transform the chunked head does not compute; `what` names it (the message adds
    the chunked loss's remedy)."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what}; patch without loss_chunks (HF's loss on the whole logits)")
        self.what = what


@functools.cache
def _forward_lines(cls: type) -> tuple[str, ...] | None:
    """The source lines of `cls.forward` (decorators unwrapped), None without source; read once
    per class (the log-probabilities check runs per micro-batch)."""
    try:
        return tuple(inspect.getsource(inspect.unwrap(cls.forward)).splitlines())
    except (OSError, TypeError):
        return None


def _read(model: Any, chain: str) -> Any:
    value = model
    for name in chain.split(".")[1:]:  # "self.config.logits_scaling" -> config, logits_scaling
        value = getattr(value, name)
    return value


def check_plain_head(model: Any) -> None:
    """Raise `LogitMapError` naming the head unless `model`'s LM head computes `x @ weight.T + bias`
    alone (an `nn.Linear`'s own forward, no other parameter): a chunked head computes exactly
    that (Dory's head, a Linear scaling its logits by a learnt per-token parameter, is not)."""
    hf = hf_model(model)
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    if not isinstance(head, nn.Module):
        return  # no head module to chunk: the callers' own checks name it
    forward = getattr(type(head), "forward", None)
    others = sorted(n for n, _ in head.named_parameters() if n not in ("weight", "bias"))
    if forward is not nn.Linear.forward or others:
        raise LogitMapError(f"{type(hf).__name__}'s LM head {type(head).__name__} computes more than a linear layer "
                            f"(its own forward{', parameters ' + str(others) if others else ''}); the chunked head "
                            "computes x @ weight.T + bias alone")


def logit_softcap(model: Any) -> float | None:
    """The tanh softcap `model`'s forward applies to its logits (Gemma 2's
    `final_logit_softcapping`, RecurrentGemma's `logits_soft_cap`), None when off."""
    hf = hf_model(model)
    config = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    lines = _forward_lines(type(hf)) or ()
    for field in SOFTCAPS:
        value = getattr(config, field, None)
        if value and (field == SOFTCAPS[0] or any(field in line for line in lines)):
            return float(value)
    return None


def logit_maps(model: Any) -> tuple[tuple[str, float], ...]:
    """(("*" or "/", value), ...) that `model`'s forward applies to the LM head's logits before
    its loss, in order (see the module docstring); raises `LogitMapError` naming a field it
    rescales by in a form not recognised here."""
    hf = hf_model(model)
    lines = _forward_lines(type(hf))
    maps, read = [], set()
    for line in lines or ():
        found = _STATEMENT.match(line)
        if found is None or found.group(2).rsplit(".", 1)[1] in SOFTCAPS:
            continue
        op, chain = found.groups()
        value = _read(hf, chain)
        if not isinstance(value, Real) or isinstance(value, bool):
            raise LogitMapError(f"{type(hf).__name__}.forward scales its logits by {chain} = {value!r}, not a number")
        read.add(chain.rsplit(".", 1)[1])
        if value != 1:
            maps.append((op, float(value)))
    config = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    # a line about the logits or the head (MiniCPM3 scales its hidden states before the head: not a map)
    writes = [line for line in lines or () if re.search(r"\b(?:logits|lm_head)\b", line)]
    for field in SCALE_FIELDS:
        value = getattr(config, field, None)
        named = lines is None or any(field in line for line in writes)
        if value not in (None, 1, 1.0) and named and field not in read:
            raise LogitMapError(f"{type(hf).__name__} rescales its logits by {field}={value!r} in a form the chunked "
                                "loss does not read (a statement `logits = logits * / self.<...>` of its forward)")
    return tuple(maps)

