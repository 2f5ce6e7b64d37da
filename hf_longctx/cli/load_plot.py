"""The `--plot` figure of `hf-longctx plan`: per-rank load of one sampled step.

Where it sits: after `capacity/search.py` has chosen the best setting. One step's documents
(from a lengths file, or a seeded long-tailed sample) are planned with `plan_microbatches`
for that setting and drawn as one stacked bar per DP rank, one segment per micro-batch
slot's cost (`CostModel.from_config`): with FSDP every rank waits for the slowest at each
slot, so equal bars and segments are the goal (Hydraulis / FlexSP). `--flex`
(`draw_flex_load`) plans with `plan_flexible` and labels each segment with the rank's
group size. matplotlib (the `bench` extra) is imported only when a figure is drawn."""

from __future__ import annotations

import gzip
import json
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from hf_longctx.data.cost import CostModel, GroupCost
from hf_longctx.flex.plan import FlexPlan
from hf_longctx.data.plan import Plan


def read_lengths(path: str | Path) -> np.ndarray:
    """Document lengths from a text file (one integer per line) or a JSON list; `.gz` ok."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--lengths-file {str(path)!r} does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        text = fh.read()
    stem = path.name[:-3] if path.suffix == ".gz" else path.name
    try:
        values = json.loads(text) if stem.endswith(".json") else [int(x) for x in text.split()]
        arr = np.asarray(values, dtype=np.int64)
    except (ValueError, TypeError) as e:
        raise ValueError(f"--lengths-file {str(path)!r}: expected integers (one per line or a JSON list): {e}") from None
    if arr.ndim != 1 or arr.size == 0 or (arr < 1).any():
        raise ValueError(f"--lengths-file {str(path)!r}: need a non-empty list of positive lengths")
    return arr


def synthetic_lengths(max_len: int, seed: int = 0, count: int = 100_000) -> np.ndarray:
    """A long-tailed pool: log-normal lengths (median ~1K tokens, sigma 1.5, like web text)
    clipped to [16, max_len], drawn with a fixed seed so the figure is reproducible."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=np.log(1024), sigma=1.5, size=count), 16, max_len).astype(np.int64)


def sample_step(pool: np.ndarray, total_tokens: int, max_len: int, seed: int = 0) -> np.ndarray:
    """Documents drawn (with replacement, fixed seed) until they hold `total_tokens`;
    lengths clipped to `max_len` (one micro-batch)."""
    rng = np.random.default_rng(seed)
    out, have = [], 0
    while have < total_tokens:
        n = int(min(pool[rng.integers(len(pool))], max_len))
        out.append(n)
        have += n
    return np.asarray(out, dtype=np.int64)


def slot_costs(plan: Plan, cost: CostModel) -> np.ndarray:
    """[dp, micro-batches] cost of each rank's micro-batch slot (padded pieces)."""
    costs = np.zeros((plan.dp_size, plan.num_microbatches))
    for r in range(plan.dp_size):
        for m, mb in enumerate(plan.ranks[r]):
            costs[r, m] = sum(cost(plan.padded_length(p)) for p in mb)
    return costs


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "--plot needs matplotlib: pip install matplotlib  (or pip install 'hf_longctx[bench]')"
        ) from None
    return plt


def draw_load(plan: Plan, cost: CostModel, path: str | Path, title: str) -> dict[str, Any]:
    """Save the stacked per-rank bar chart to `path` (PNG); returns `plan.stats(cost)`."""
    plt = _pyplot()
    costs = slot_costs(plan, cost) / 1e12  # TFLOP (an amount of work, not a rate)
    stats = plan.stats(cost)
    dp, slots = costs.shape
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * dp + 3) + 2, 4.5))
    bottom = _stack(plt, ax, costs, [f"micro-batch {m}" for m in range(slots)])
    ideal = costs.sum() / dp
    ax.axhline(ideal, color="black", linestyle="--", linewidth=1, label="ideal (total / dp)")
    ax.set_xlabel("DP rank")
    ax.set_ylabel("step cost (TFLOP, forward + backward)")
    ax.set_xticks(np.arange(dp))
    _title(ax, fig, title)
    note = ("\ndp 1: one bar, balanced by construction (nothing to balance\nacross ranks); --flex compares group sizes"
            if dp == 1 else "")
    ax.text(0.01, 0.98, f"synchronised step / ideal = {stats['synced_over_ideal']:.3f}\n"
            f"max rank / mean rank = {stats['rank_max_over_mean']:.3f}\n"
            f"{stats['num_pieces']} documents, {slots} micro-batches per rank, fill {stats['fill']:.0%}{note}",
            transform=ax.transAxes, va="top", fontsize=8, bbox=dict(facecolor="white", alpha=0.8, linewidth=0))
    _save(plt, fig, ax, path, bottom.max() * 1.3)
    return stats


def flex_rank_costs(plan: FlexPlan, cost: GroupCost) -> tuple[np.ndarray, np.ndarray]:
    """([world, slots] cost of each rank's group micro-batch in each slot (every rank of a
    group runs the group's whole micro-batch time), [world, slots] that group's size)."""
    costs = np.zeros((plan.world_size, plan.num_slots))
    sizes = np.zeros((plan.world_size, plan.num_slots), dtype=np.int64)
    for m, slot in enumerate(plan.slots):
        for g in slot:
            costs[g.ranks.start : g.ranks.stop, m] = plan.group_cost(g, cost)
            sizes[g.ranks.start : g.ranks.stop, m] = g.size
    return costs, sizes


def draw_flex_load(plan: FlexPlan, cost: GroupCost, path: str | Path, title: str, unit: str = "s") -> dict[str, Any]:
    """The flexible plan as a stacked per-rank bar chart: one segment per slot (colour), each
    labelled with the size of the group the rank is in (so a slot's layout reads across the
    ranks: [4] [2+1+1] ...); the slot layouts are listed in the text box. Returns
    `plan.stats(cost)`."""
    plt = _pyplot()
    costs, sizes = flex_rank_costs(plan, cost)
    stats = plan.stats(cost)
    world, slots = costs.shape
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * world + 3) + 2, 4.5))
    labels = [f"slot {m}: [{'+'.join(str(g.size) for g in plan.slots[m])}]" for m in range(slots)]
    bottom = _stack(plt, ax, costs, labels, sizes if world <= 32 else None)  # sizes unreadable beyond ~32 bars
    ax.axhline(stats["ideal_step"], color="black", linestyle="--", linewidth=1, label="ideal")
    ax.set_xlabel("rank (segment label: size of its SP group in that slot)")
    ax.set_ylabel(f"busy time per rank ({unit}, modelled)")
    ax.set_xticks(np.arange(world) if world <= 32 else np.arange(0, world, max(1, world // 16)))
    _title(ax, fig, title)
    step = "synchronised step" if plan.equal_calls else "makespan (unequal counts)"
    ax.text(0.01, 0.98, f"{step} / ideal = {stats['synced_over_ideal']:.3f}\n"
            f"per-rank busy max / mean = {stats['busy_max_over_mean']:.3f}\n"
            f"{len(plan.lengths)} documents, {slots} slots", transform=ax.transAxes, va="top", fontsize=8,
            bbox=dict(facecolor="white", alpha=0.8, linewidth=0))
    _save(plt, fig, ax, path, bottom.max() * 1.35)
    return stats


def draw_step_record(record: dict[str, Any], path: str | Path) -> None:
    """`trainer.last_plan` (its `to_dict()`, or the JSON `StepRecord.save` wrote) as two
    panels: the planned tokens of every group in every micro-batch slot (one stacked bar
    per group position, one segment per slot), and this rank's measured seconds per
    micro-batch; the modelled balance is in the title."""
    plt = _pyplot()
    slots = record["slot_tokens"]
    width = max((len(s) for s in slots), default=0)
    tokens = np.zeros((width, len(slots)))
    for j, slot in enumerate(slots):
        for i, (_, n) in enumerate(slot):
            tokens[i, j] = n
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(max(6.0, 0.5 * width + 3) + 6, 4.5))
    _stack(plt, ax, tokens, [f"slot {j}: {g}" for j, g in enumerate(record["groups"])])
    ax.set_xlabel("group (DP rank for a fixed degree)")
    ax.set_ylabel("planned tokens")
    ax.set_xticks(np.arange(width))
    times = np.asarray(record["microbatch_s"], dtype=float)
    bx.bar(np.arange(len(times)), times, color="grey")
    bx.set_xlabel("micro-batch (this rank)")
    bx.set_ylabel("measured seconds (forward + backward)")
    modelled = record.get("modelled", {})
    balance = modelled.get("synced_over_ideal")
    _title(ax, fig, f"step {record['step']}: {len(record['lengths'])} pieces, {len(slots)} slots"
           + (f"; modelled synchronised step / ideal = {balance:.3f}" if balance is not None else ""))
    bx.set_title(f"measured on this rank: {record['measured_s']:.3f} s", fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _stack(plt, ax, costs: np.ndarray, labels: list[str], segment_text: np.ndarray | None = None) -> np.ndarray:
    """Stacked bars of costs [bars, segments], one colour per segment (legend up to 12); with
    `segment_text` [bars, segments], each visible segment is labelled with its entry.
    Returns the bars' totals."""
    cmap = plt.get_cmap("tab20")
    n, segments = costs.shape
    bottom = np.zeros(n)
    for m in range(segments):
        ax.bar(np.arange(n), costs[:, m], bottom=bottom, color=cmap(m % 20), edgecolor="white", linewidth=0.5,
               label=labels[m] if segments <= 12 else None)
        if segment_text is not None:
            for r in range(n):
                if costs[r, m] > 0.04 * costs.sum(axis=1).max():
                    ax.text(r, bottom[r] + costs[r, m] / 2, str(segment_text[r, m]), ha="center", va="center", fontsize=7)
        bottom += costs[:, m]
    return bottom


def _title(ax, fig, title: str) -> None:
    """The title wrapped to the figure's width (about 15 characters per inch at 9 pt)."""
    width = int(fig.get_figwidth() * 15)
    ax.set_title("\n".join(textwrap.fill(line, width) for line in title.split("\n")), fontsize=9)


def _save(plt, fig, ax, path: str | Path, top: float) -> None:
    if ax.get_legend_handles_labels()[0]:  # beside the axes, never over the bars
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.set_ylim(0, top)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
