"""What the planner turns, per setting, where a memory binds: the settings' extra knobs.

Where it sits: `capacity/search.rank_settings` estimates every (mesh, preset) setting
(`capacity/estimate.estimate_memory`) and hands the ones a memory rules out here; each function
returns the setting with the knob `patch()` takes for it, and its estimate, or both unchanged.
`inputs_on_device`: host memory binds and the GPU has room (the last N layers keep their
checkpointed inputs on the GPU).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hf_longctx.capacity.estimate import Setting


def inputs_on_device(s: Setting, mem: Any, memory: Any, layers: int, gpu: float, host: float) -> tuple:
    """(setting, estimate) with the fewest last layers keeping their checkpointed inputs on the
    GPU (`patch(..., inputs_on_device=N)`) that brings the host bytes per GPU within `host`
    while the GPU peak stays within `gpu`; `s` and `mem` unchanged when no N does.
    `memory(setting)` estimates one setting; host falls and the GPU peak rises with N (bisection)."""
    lo, hi = 1, layers
    best = memory(replace(s, inputs_on_device=hi))  # the estimate at `hi`, which fits the host
    if best.host > host:
        return s, mem
    while lo < hi:
        mid = (lo + hi) // 2
        est = memory(replace(s, inputs_on_device=mid))
        if est.host <= host:
            hi, best = mid, est
        else:
            lo = mid + 1
    return (replace(s, inputs_on_device=hi), best) if best.peak <= gpu else (s, mem)
