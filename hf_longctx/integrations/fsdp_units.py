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
