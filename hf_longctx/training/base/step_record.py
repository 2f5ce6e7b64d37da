"""What the trainer keeps of its last optimizer step: `trainer.last_plan`.

Where it sits: at the end of the training data flow. `training/sft/data.py` plans each step
(the cost-balanced `Plan` of `data/packing.py`, or a flexible `FlexPlan` of SP groups) and
hands the plan and its modelled statistics to `LongContextTrainerMixin.training_step`,
which times every micro-batch on this rank and stores one `StepRecord`. Users read it to
see which groups and documents the step ran and how the cost model's times compare with
the measured ones (Hydraulis / FlexSP balance); `cli/load_plot.py` draws it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
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

    def slot_tokens(self) -> list[list[tuple[int, int]]]:
        """Per micro-batch slot, (group size, tokens) of every group (fixed plans: one per DP
        rank, size = the SP degree, 0 when unknown) in rank order."""
        plan = self.plan
        if hasattr(plan, "slots"):  # FlexPlan: groups of each slot, their documents' tokens
            return [[(g.size, int(sum(plan.lengths[d] for d in g.docs))) for g in slot] for slot in plan.slots]
        ranks = getattr(plan, "ranks", None) or []
        slots = max((len(r) for r in ranks), default=0)
        return [[(0, int(sum(plan.pieces[p].length for p in r[j]))) if j < len(r) else (0, 0) for r in ranks]
                for j in range(slots)]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (what `hf-longctx step-plot` draws)."""
        return {
            "step": self.step, "lengths": list(self.lengths), "groups": self.groups, "slot_tokens": self.slot_tokens(),
            "modelled": {k: v for k, v in self.modelled.items() if isinstance(v, (int, float, str))},
            "microbatch_s": list(self.microbatch_s), "measured_s": self.measured_s,
        }

    def save(self, path: str | Path) -> None:
        """Write `to_dict()` as JSON (e.g. from rank 0 after `trainer.train()`)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))
