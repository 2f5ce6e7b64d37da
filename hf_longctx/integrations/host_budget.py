"""The host-memory check of offloading memory options: refuse a micro-batch before it fills the host.

Where it sits: `integrations/memory.py` installs it (a pre-hook on the first decoder layer)
when the patch offloads to pinned host memory (checkpointed inputs or FPDT's K/V) on CUDA.
Before each forward it computes the micro-batch's pinned bytes per rank with the planner's
budget (`capacity/budget.step_budget`, pool size classes included) and compares them with
this rank's share of the node: physical memory × (1 - HEADROOM) / LOCAL_WORLD_SIZE.
Guarantee: over it, a HostMemoryExceeded (ValueError) naming both figures and the fix,
raised before any offload instead of the OOM killer ending the job mid-step; the ranks of an
SP group hold equal tokens (invariant 3), so they decide alike."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

HEADROOM = 0.1  # of the node's memory left to the OS, the data pipeline, the CPU optimizer


def node_memory() -> int:
    """Physical memory of this node in bytes (0 if unknown)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


class HostMemoryExceeded(ValueError):
    """A micro-batch whose host offloads would not fit this rank's share of the node's memory."""


@dataclass
class HostBudget:
    """`need(tokens_local)`: host bytes one rank pins for a micro-batch; `capacity`: its share."""

    need: Callable[[int], float]
    capacity: float
    ranks_per_node: int

    @classmethod
    def for_patch(cls, dims: Any, setting: Any, sp: int, ranks_per_node: int | None = None,
                  total: int | None = None) -> "HostBudget":
        """From the model's sizes (`data/model_dims.ModelDims`), the planner `Setting` of the patch and
        the SP group size; the node's memory and ranks from the machine unless given."""
        from hf_longctx.capacity.budget import step_budget

        ranks = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        total = node_memory() if total is None else total

        def need(tokens_local: int) -> float:
            return step_budget(dims, setting, tokens=tokens_local * sp, offload=True).host

        return cls(need, total * (1 - HEADROOM) / max(1, ranks), max(1, ranks))

    def check(self, tokens_local: int) -> None:
        if not self.capacity:
            return
        need = self.need(tokens_local)
        if need > self.capacity:
            gib = 2**30
            raise HostMemoryExceeded(
                f"this micro-batch pins {need / gib:.1f} GiB of host memory per rank ({tokens_local} tokens per rank: "
                f"checkpointed layer inputs and offloaded attention state), but {self.ranks_per_node} rank(s) per node "
                f"share {self.capacity * self.ranks_per_node / gib:.1f} GiB usable host memory ({self.capacity / gib:.1f} "
                "GiB each): it would run the host out of memory. Use fewer tokens per micro-batch (max_tokens), more "
                "GPUs in the SP group, or a preset that keeps less on the host (memory='max' keeps only the layer inputs); "
                "`hf-longctx plan --host-memory ...` shows what fits"
            )
