"""The FSDP2 units of a model: which modules `FSDPPlan.apply` shards together.

Where it sits: below `integrations/accelerate.py` (whose `apply` calls `fully_shard` on these
units: every decoder layer, the input embedding and the LM head, then the root), at the end of
the data flow's set-up, after `patch()` and before the optimizer. One parameter must live in
exactly one unit, so an input embedding and an LM head that share their weight form ONE unit.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_longctx.model_walk import hf_model


def embedding_units(model: Any) -> list[list[torch.nn.Module]]:
    """The input embedding and the LM head as FSDP units: [[embed, head]] when their weights
    are tied (one parameter must live in one unit: `fully_shard([embed, head])`, a list of
    modules grouped for communication), else [[embed], [head]]; modules without parameters
    of their own are skipped."""
    hf = hf_model(model)
    embed = hf.get_input_embeddings() if hasattr(hf, "get_input_embeddings") else None
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    found = [m for m in (embed, head) if isinstance(m, torch.nn.Module) and any(True for _ in m.parameters())]
    if len(found) == 2 and found[0] is found[1]:
        found = found[:1]
    if len(found) == 2 and {id(p) for p in found[0].parameters()} & {id(p) for p in found[1].parameters()}:
        return [found]  # tied: one unit
    return [[m] for m in found]


def plan_units(model: Any, layer_classes: tuple[type, ...]) -> list[list[torch.nn.Module]]:
    """The units `FSDPPlan.apply` shards, in its order: every decoder layer, the vocabulary
    units (`embedding_units`), then the root (which takes whatever no earlier unit holds)."""
    layers = [[m] for m in model.modules() if isinstance(m, layer_classes)]
    return [*layers, *embedding_units(model), [model]]


def split_parameters(model: Any, units: list[list[torch.nn.Module]]) -> list[str]:
    """One line per Parameter whose owning modules fall into different units (FSDP2 fails on it
    at the first forward, 'shared with a parameter already managed by another FSDP group');
    a unit holds what its modules contain and no earlier unit took, as `fully_shard` does."""
    names = {id(m): n or "the model's root" for n, m in model.named_modules(remove_duplicate=False)}
    unit_of: dict[int, int] = {}  # module -> the unit that shards it
    for u, unit in enumerate(units):
        for root in unit:
            for m in root.modules():
                unit_of.setdefault(id(m), u)
    modules = dict(model.named_modules(remove_duplicate=False))
    where: dict[int, dict[int, str]] = {}  # parameter -> {unit: one of its names there}
    for name, _ in model.named_parameters(remove_duplicate=False):
        prefix, _, attr = name.rpartition(".")
        owner = modules[prefix]
        where.setdefault(id(getattr(owner, attr)), {}).setdefault(unit_of[id(owner)], name)
    problems = []
    for by_unit in where.values():
        if len(by_unit) < 2:
            continue
        held = [f"{name} (in {' + '.join(names[id(m)] for m in units[u])})" for u, name in sorted(by_unit.items())]
        problems.append(
            f"{' and '.join(held)} are one Parameter in {len(held)} FSDP2 units: fully_shard keeps each parameter in "
            "exactly one unit, so the first forward would fail ('... is shared with a parameter already managed by "
            "another FSDP group')"
        )
    return problems
