"""Which projections of a row-chunked layer's pre-attention part need no forward GEMM in its
backward: those whose outputs no backward of that part reads (memory="max").

Where it sits: `integrations/layer_run.LayerRun._pre_backward` runs the layer's pre-attention
part once more per row chunk, with gradients, to take the input's and the projections'
gradients from (dq, dk, dv). A linear's backward reads its input and weight, never its output;
RoPE's reads its tables; v goes to the kernel untouched. So under RoPE alone the q, k and v
projections' outputs are read by nothing there, and their GEMMs can be skipped
(`ops/grad_sums.SumsSlot.unread_outputs`: an uninitialised output with the weight's gradient
edge). A q/k norm (Qwen3, OLMo2) reads q and k in its backward: only v's GEMM goes. Which ones
is learnt per layer, never assumed: the part's backward on the layer's first rows as it is,
then with candidate outputs filled with NaN, and again with a large finite value; a candidate
holds when every gradient comes out the same both times (a NaN read by arithmetic propagates; a
read through a comparison or a branch, where NaN may compare like the true values, shows with the
finite value). Scratch sums: the learning adds nothing to the step.
"""

from __future__ import annotations

from typing import Callable

import torch

from hf_longctx.ops.grad_sums import GradSums, SumsSlot

POISONS = (float("nan"), 3.0e4)  # the candidate outputs' fills: NaN, and a large value bf16 and fp16 hold


def same_gradient(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Both absent, or equal (`torch.equal`: a NaN in either is never equal)."""
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)


def learn_unread(slot: SumsSlot, params: list, needs: tuple, grads_of: Callable[[], list]) -> frozenset:
    """The ids of the weights whose sink-linear outputs `grads_of` (one backward of the
    pre-attention part, returning its gradients) never reads: all candidates together, else
    one at a time and the survivors together again; empty when none holds. One reference run
    and two poisoned runs per trial (`POISONS`), each with its own scratch `GradSums` over `params`."""

    def run(ids: frozenset, poison: float | None, seen: set | None = None) -> list:
        sums = GradSums(params, needs)
        with slot.bound(sums), slot.unread_outputs(ids, poison=poison, seen=seen):
            out = grads_of()
        return out + sums.grads(rounded=False)

    seen: set = set()
    reference = run(frozenset(), None, seen)

    def holds(ids: frozenset) -> bool:  # NaN shows an arithmetic read; a large finite value one through a comparison
        return all(all(same_gradient(a, b) for a, b in zip(reference, run(ids, fill))) for fill in POISONS)

    every = frozenset(seen)
    chosen = every if every and holds(every) else frozenset(i for i in every if holds(frozenset({i})))
    if len(chosen) > 1 and chosen != every and not holds(chosen):
        chosen = frozenset()
    return chosen
