"""DPO's reference, held through training or precomputed once: which the planner picks.

Where it sits: after `capacity/search.rank_settings` ran for `--task dpo` (the reference's fp32
ZeRO-3 shards held, its forward a memory phase of every micro-batch) and for
"dpo-precomputed" (`DPOConfig(precompute_ref_log_probs=True)`: neither; its per-pair sums come
with the data, `training/dpo/precompute.py`). The step-time model does not time the
reference's forward, so it is charged here as a no-grad forward's share of a step's compute:
1/3 (forward : backward = 1 : 2), 1/4 with checkpointing (the recompute is a second forward).
The precomputed reference costs that same forward once per pair, in a pass before training:
what one epoch of the held reference costs, saved on every later epoch. Its memory is the
training step's or less (no gradients, no optimizer states yet). `hf-longctx plan --task dpo`
prints the held reference's table, then this choice, then the suggestion of the reference picked."""

from __future__ import annotations

from typing import Any, Sequence


def forward_share(checkpoint: bool) -> float:
    """A no-grad forward's share of one training step's compute."""
    return 1 / 4 if checkpoint else 1 / 3


def _first(ranked: Sequence[Any]) -> Any:
    return next((c for c in ranked if c.feasible), None)


def _rate(c: Any, per: float = 1.0, about: str = "") -> str:
    """Its modelled tokens/s (divided by `per`), or that its GPU has no step time."""
    return f"{about}{c.tokens_per_second / per:,.0f} tokens/s" if c.time is not None else "(no step time on this GPU)"


def _describe(c: Any, gib: float) -> str:
    s = c.setting
    offload = ", param offload" if s.param_offload else ""
    return f"U{s.ulysses}xR{s.ring}, fpdt {s.fpdt_chunks}, dp {c.dp}{offload}: peak {c.memory.peak / gib:.1f} GiB"


def pick_reference(held: Sequence[Any], precomputed: Sequence[Any]) -> tuple[str, str | None]:
    """(one paragraph: the held reference's best setting (its forward charged), the precomputed
    reference at that same setting and at its own best, and which is picked, and why; the task
    picked, "dpo-precomputed", or None where nothing fits). The plan suggests the picked task's
    best setting, so its suggestion and this paragraph agree."""
    gib = 2.0**30
    h, p = _first(held), _first(precomputed)
    if p is None:
        return ("DPO reference: nothing fits with the reference precomputed either (see the closest setting above).",
                None)
    best = (f"its best: {_describe(p, gib)}, {_rate(p)}; a one-off reference pass before "
            f"training costs ~{forward_share(p.setting.checkpoint):.0%} of a step's time per step of data")
    if h is None:
        return (f"DPO reference: held, nothing fits; precomputed (DPOConfig(precompute_ref_log_probs=True)), {best}. "
                "Picks precomputed: only it fits; the suggestion below is its best."), "dpo-precomputed"
    share = forward_share(h.setting.checkpoint)
    same = next((c for c in precomputed if c.setting == h.setting), None)
    at_same = "" if same is None else (
        f"at that setting GPU peak {same.memory.peak / gib:.1f} GiB ({(same.memory.peak - h.memory.peak) / gib:+.1f}), "
        f"host {same.memory.host / gib:.1f} GiB/GPU ({(same.memory.host - h.memory.host) / gib:+.1f}: the reference's "
        "fp32 shards and its forward's working memory leave) and no reference forward per step; ")
    return (f"DPO reference: held: {_describe(h, gib)}, {_rate(h, 1 + share, '~')} with its "
            f"forward charged (+{share:.0%} of the step; the table's tokens/s leave it out). Precomputed "
            f"(DPOConfig(precompute_ref_log_probs=True)): {at_same}{best}. Picks precomputed: the same reference "
            f"forwards over the first epoch, {1 + share:.2f}x the steps per second from the second epoch on, less "
            "memory; the held reference only for a dataset that changes between epochs (a transform, refused with "
            "precompute_ref_log_probs). The suggestion below is the precomputed reference's best."), "dpo-precomputed"
