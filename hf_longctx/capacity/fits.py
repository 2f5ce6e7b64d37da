"""What the planner turns, per setting, where a memory binds: the settings' extra knobs.

Where it sits: `capacity/search.rank_settings` estimates every (mesh, preset) setting
(`capacity/estimate.estimate_memory`) and hands the ones a memory rules out here; each function
returns the setting with the knob `patch()` takes for it, and its estimate, or both unchanged.
`inputs_on_device`: host memory binds and the GPU has room (the last N layers keep their
checkpointed inputs on the GPU). `loss_rows_within`: GPU memory binds where the LM head's "auto"
chunks (`ops/loss_rows.py`: compute-bound, at least 2048 rows) make the loss phase the peak; the
largest chunk that fits, never below the memory rule's (`patch(..., loss_chunk_rows=R)`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hf_longctx.capacity.estimate import ModelDims, Setting
from hf_longctx.ops.loss_rows import loss_chunk_rows, memory_rows

ROW_STEP = 128  # rows a lowered LM-head chunk is a multiple of (tensor-core tiles); read-only constant


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


def loss_rows_within(s: Setting, mem: Any, memory: Any, dims: ModelDims, tokens: int, gpu: float) -> tuple:
    """(setting, estimate) with the largest LM-head chunk (`loss_chunk_rows`, a multiple of
    ROW_STEP or the memory rule's rows) whose estimated GPU peak is within `gpu`, where the
    "auto" chunk's is not; `s` and `mem` unchanged when that one fits, the loss is not chunked
    "auto", or not even the memory rule's rows fit. `memory(setting)` estimates one setting;
    the peak grows with the rows (bisection)."""
    if mem.peak <= gpu or s.loss_chunks != 0 or s.loss_chunk_rows:
        return s, mem
    rows = tokens // s.sp
    floor, auto = memory_rows(dims.vocab, dims.hidden, rows), loss_chunk_rows(dims.vocab, dims.hidden, rows)
    best = memory(replace(s, loss_chunk_rows=floor))
    if floor >= auto or best.peak > gpu:
        return s, mem
    lo, hi, chosen = floor // ROW_STEP + 1, (auto - 1) // ROW_STEP, floor  # candidates: k * ROW_STEP in (floor, auto)
    while lo <= hi:
        mid = (lo + hi) // 2
        est = memory(replace(s, loss_chunk_rows=mid * ROW_STEP))
        if est.peak <= gpu:
            chosen, best, lo = mid * ROW_STEP, est, mid + 1
        else:
            hi = mid - 1
    return replace(s, loss_chunk_rows=chosen), best
