"""What the trainer keeps of its last optimizer step: `trainer.last_plan`.

Where it sits: at the end of the training data flow. `training/steps.py` plans each step
(the cost-balanced `Plan` of `data/packing.py`, or a flexible `FlexPlan` of SP groups) and
hands the plan and its modelled statistics to `LongContextTrainerMixin.training_step`,
which times every micro-batch on this rank and stores one `StepRecord`. Users read it to
see which groups and documents the step ran and how the cost model's times compare with
the measured ones (Hydraulis / FlexSP balance); `planning/plot.py` draws it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step as planned and as run on this rank.

    `plan`: the step's plan (`Plan`: `ranks[dp][micro-batch] -> piece indices`, `pieces`
    with each piece's document and token range; or `FlexPlan`: `slots` of groups, each with
    its size and documents). `lengths`: the trained pieces' token counts. `modelled`: the
    plan's `stats(cost)` (e.g. `synced_step`, `ideal`, `synced_over_ideal`; empty without a
    cost model). `microbatch_s`: this rank's measured seconds per micro-batch (forward +
    backward, wall clock); `measured_s`: their sum.
    """

    step: int
    plan: Any
    lengths: tuple[int, ...]
    modelled: dict[str, Any] = field(default_factory=dict)
    microbatch_s: tuple[float, ...] = ()

    @property
    def measured_s(self) -> float:
        return float(sum(self.microbatch_s))

    @property
    def groups(self) -> list[str]:
        """Each micro-batch slot's SP groups ("[4]", "[2+1+1]" for a flexible plan; "[dp x sp]" fixed)."""
        layouts = getattr(self.plan, "layouts", None)
        if callable(layouts):
            return ["[" + "+".join(str(s) for s in slot) + "]" for slot in layouts()]
        ranks = getattr(self.plan, "ranks", None) or []
        return [f"[{len(ranks)} DP rank(s)]"] * max((len(r) for r in ranks), default=0)
