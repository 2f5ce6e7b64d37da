"""The figures drawn from a page's own table: the numbers a measured page prints, as a picture.

Where it sits: docs/hooks/figures.py calls every entry of `FIGURES` while the site builds;
each reads the Markdown of the pages it names (the command's output pasted there with its
date and machine, `page_tables.find`) and draws one PNG, so a figure and its table always
agree, and a table that loses a column fails the build. Each function returns the series it
drew (tests/unit/test_docs_figures.py compares them with the page). The pages show each
picture under its table as `img/NAME.png`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Mapping

import figure_style as style
from page_tables import find, number

LONGEST = "guides/longest-context.md"
DEMO = "measured/demo.md"
BF16 = "measured/bf16.md"
MEMORY = "measured/memory.md"
PLANNING = "measured/planning.md"
MIXERS = "measured/hybrid-mixers.md"
ATTENTION = "measured/attention.md"
HOT_PATH = "measured/hot-path.md"
POST_TRAINING = "measured/post-training.md"
GPU = "measured/gpu.md"


def _published(cell: str) -> tuple[str, float] | None:
    """("ALST", tokens) from a "published" cell such as "ALST: 1.2M (one H200)"; None for "—"."""
    m = re.match(r"\s*([\w-]+):\s*([\d.]+[KM])", cell)
    return (m.group(1), number(m.group(2), suffixes=True)) if m else None


def longest_context(pages: Mapping[str, str], out: Path) -> dict:
    """The planner's longest context per cluster beside the published anchors (ALST, FPDT)."""
    table = find(pages[LONGEST], "model", "GPUs, host memory per node", "planner's longest", "published")
    rows = table.records()
    labels = [f"{r['model']}, {r['GPUs, host memory per node'].split(',')[0]}" for r in rows]
    planner = [number(r["planner's longest"], suffixes=True) / 2**20 for r in rows]
    anchors = [_published(r["published"]) for r in rows]
    fig, ax = style.new(0.42 * len(rows) + 1.0)
    y = list(range(len(rows)))[::-1]
    ax.barh(y, planner, color=style.COLORS[0], height=0.6, label="hf_longctx: the planner's longest (estimate)")
    for yi, value in zip(y, planner):
        ax.text(value * 1.04, yi, f"{value:.2f}M", va="center", fontsize=7)
    marks = {}
    for yi, anchor in zip(y, anchors):
        if anchor:
            system, tokens = anchor
            color = style.COLORS[1] if system == "ALST" else style.COLORS[2]
            marks[system] = ax.scatter([tokens / 2**20], [yi], marker="D", s=36, color=color, zorder=3,
                                       label=f"{system}, published")
            written = re.search(r"[\d.]+[KM]", rows[len(y) - 1 - yi]["published"]).group(0)
            ax.annotate(f"{system} {written}", (tokens / 2**20, yi), textcoords="offset points", xytext=(0, 8),
                        ha="center", fontsize=6.5, color=color,
                        bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.9})
    ax.set_xscale("log")
    ticks = [0.25, 0.5, 1, 2, 4, 8, 16, 32]
    ax.set_xticks(ticks, [f"{t:g}M" for t in ticks])
    ax.set_xlim(0.15, 48)
    ax.set_yticks(y, labels)
    ax.set_xlabel("tokens of one sequence (M = 2^20), log scale")
    ax.set_title("Longest context per cluster: the planner's estimate (bf16, AdamW) beside the published figures")
    handles = [ax.containers[0], *marks.values()]
    ax.legend(handles=handles, loc="upper right", fontsize=7)
    style.save(fig, out)
    return {"labels": labels, "planner_M": planner, "published": anchors}


def _slots(layout: str) -> list[list[int]]:
    """"`[4] [2+2] [2+1+1]`" -> [[4], [2, 2], [2, 1, 1]]: each slot's group sizes."""
    return [[int(s) for s in re.split(r"[+,]", slot)] for slot in re.findall(r"\[([\d+,]+)\]", layout)]


def demo(pages: Mapping[str, str], out: Path) -> dict:
    """The flexible demo: step 1's slot layouts (groups tiling the ranks) and tokens/s per run."""
    table = find(pages[DEMO], "demo", "train tok/s", "mean modelled step / ideal", "slot layouts (step 1)")
    rows = table.records()
    slots = _slots(rows[0]["slot layouts (step 1)"])
    world = sum(slots[0])
    fig, (grid, bars) = style.new(2.8, 2, gridspec_kw={"width_ratios": [1.4, 1]})
    from matplotlib.patches import Rectangle

    sizes = sorted({s for groups in slots for s in groups}, reverse=True)
    for m, groups in enumerate(slots):
        start = 0
        for size in groups:
            grid.add_patch(Rectangle((m + 0.05, start + 0.05), 0.9, size - 0.1,
                                     color=style.COLORS[sizes.index(size) % len(style.COLORS)], alpha=0.55))
            grid.text(m + 0.5, start + size / 2, f"{size}", ha="center", va="center", fontsize=8)
            start += size
    grid.set_xlim(0, len(slots)), grid.set_ylim(0, world)
    grid.set_xticks([m + 0.5 for m in range(len(slots))], [f"slot {m + 1}" for m in range(len(slots))])
    grid.set_yticks([r + 0.5 for r in range(world)], [f"rank {r}" for r in range(world)])
    grid.set_title(f"step 1: SP groups of each micro-batch slot ({rows[0]['demo'].strip('`')})")
    names = [r["demo"].strip("`") for r in rows]
    tps = [number(r["train tok/s"]) for r in rows]
    ideal = [number(r["mean modelled step / ideal"]) for r in rows]
    bars.bar(range(len(rows)), tps, color=style.COLORS[0], width=0.55)
    for i, (t, s) in enumerate(zip(tps, ideal)):
        bars.text(i, t, f"{t:,.0f} tok/s\nstep / ideal {s:.3f}", ha="center", va="bottom", fontsize=7)
    bars.set_xticks(range(len(rows)), names)
    bars.set_ylim(0, max(tps) * 1.3)
    bars.set_ylabel("trained tokens/s (2 cores, loaded)")
    bars.set_title("make demo DEMO_ARGS=...: the two flexible runs")
    style.save(fig, out)
    return {"slots": slots, "demo": names, "tok_s": tps, "step_over_ideal": ideal}


def bf16_isa(pages: Mapping[str, str], out: Path) -> dict:
    """`make test-bf16-isa`: the result and wall time under each forced CPU kernel set."""
    table = find(pages[BF16], "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "result", "wall (loaded machine)")
    rows = table.records()
    labels = [f"{r['ATEN_CPU_CAPABILITY']} / {r['ONEDNN_MAX_CPU_ISA']}" for r in rows]
    wall = [number(r["wall (loaded machine)"]) for r in rows]
    fig, ax = style.new(0.35 * len(rows) + 1.0)
    y = list(range(len(rows)))[::-1]
    ax.barh(y, wall, color=style.COLORS[2], height=0.6)
    for yi, w, r in zip(y, wall, rows):
        ax.text(w * 1.01, yi, f"{r['result']}, {w:.0f} s", va="center", fontsize=7)
    ax.set_yticks(y, labels)
    ax.set_xlim(0, max(wall) * 1.25)
    ax.set_xlabel("wall time of the bf16 tests, s (the shared 2-core machine under load)")
    ax.set_title("bf16 tests under each forced CPU kernel set (ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA)")
    style.save(fig, out)
    return {"settings": labels, "wall_s": wall, "results": [r["result"] for r in rows]}


def memory_budget(pages: Mapping[str, str], out: Path) -> dict:
    """The per-token budget by preset at the longest measured length: the CPU census against
    the planner, on the device and on the host."""
    table = find(pages[MEMORY], "shape", "mode", "tokens", "device vec", "planner vec", "host vec/layer",
                 "planner host vec/layer")
    rows = table.records()
    longest = max(number(r["tokens"]) for r in rows)
    rows = [r for r in rows if number(r["tokens"]) == longest]
    shapes = sorted({r["shape"] for r in rows})
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = style.new(3.2, 2)
    drawn = {}
    for ax, (measured, planned, what) in zip(axes, [("device vec", "planner vec", "GPU: peak above the weights"),
                                                    ("host vec/layer", "planner host vec/layer", "host: per layer")]):
        width = 0.8 / len(shapes)
        for k, shape in enumerate(shapes):
            by_mode = {r["mode"]: r for r in rows if r["shape"] == shape}
            xs = [i + (k - (len(shapes) - 1) / 2) * width for i in range(len(modes))]
            got = [number(by_mode[m][measured]) for m in modes]
            plan = [number(by_mode[m][planned]) for m in modes]
            ax.bar(xs, got, width * 0.9, color=style.COLORS[k], label=f"shape {shape}, measured")
            ax.scatter(xs, plan, marker="_", s=120, color="black", zorder=3, label="planner" if k == 0 else None)
            drawn[(what, shape)] = (got, plan)
        ax.set_xticks(range(len(modes)), [m.replace(" offload", "\noffload") for m in modes], fontsize=7)
        ax.set_ylabel("hidden-size bf16 vectors per token")
        ax.set_title(f"{what} ({int(longest) // 1024}K tokens, Ulysses 4)")
        ax.legend(fontsize=7)
    style.save(fig, out)
    return {"tokens": longest, "modes": modes, "series": drawn}


def packing_balance(pages: Mapping[str, str], out: Path) -> dict:
    """Synchronised step time over the ideal, per length distribution and planner (mean, with
    the worst step as the whisker)."""
    table = find(pages[PLANNING], "distribution", "strategy", "synced / ideal")
    rows = table.records()
    dists = list(dict.fromkeys(r["distribution"] for r in rows))
    strategies = list(dict.fromkeys(re.sub(r"[*_]|\s*\(.*\)", "", r["strategy"]).strip() for r in rows))
    fig, ax = style.new(3.0)
    width = 0.8 / len(strategies)
    drawn = {}
    for k, strategy in enumerate(strategies):
        means, worst = [], []
        for d in dists:
            cell = next(r["synced / ideal"] for r in rows if r["distribution"] == d
                        and re.sub(r"[*_]|\s*\(.*\)", "", r["strategy"]).strip() == strategy)
            mean, high = [float(x) for x in re.findall(r"[\d.]+", cell)[:2]]
            means.append(mean), worst.append(high)
        xs = [i + (k - (len(strategies) - 1) / 2) * width for i in range(len(dists))]
        ax.bar(xs, [m - 1 for m in means], width * 0.9, bottom=1, color=style.COLORS[k], label=strategy,
               yerr=[[0] * len(means), [w - m for w, m in zip(worst, means)]], capsize=2)
        drawn[strategy] = means
    ax.set_xticks(range(len(dists)), dists)
    ax.set_ylim(1, None)
    ax.set_ylabel("synced step / ideal (1 = perfect balance)")
    ax.set_title("Workload balance of one step, 8 ranks x 8 micro-batches (mean over 16 steps; whisker: the worst)")
    ax.legend(fontsize=7)
    style.save(fig, out)
    return {"distributions": dists, "means": drawn}


def mixer_bytes(pages: Mapping[str, str], out: Path) -> dict:
    """Bytes a linear mixer's layer sends per rank, head all-to-all against state passing, by SP degree."""
    table = find(pages[MIXERS], "mixer", "SP", "heads 32K MiB", "state 32K MiB", "heads 128K MiB", "state 128K MiB")
    rows = table.records()
    mixers = list(dict.fromkeys(r["mixer"] for r in rows))
    fig, axes = style.new(3.0, len(mixers), sharey=True)
    drawn = {}
    for ax, mixer in zip(axes, mixers):
        mine = [r for r in rows if r["mixer"] == mixer]
        sp = [int(number(r["SP"])) for r in mine]
        for k, column in enumerate(("heads 32K MiB", "heads 128K MiB", "state 32K MiB", "state 128K MiB")):
            values = [number(r[column]) if "n/a" not in r[column] else None for r in mine]
            pts = [(s, v) for s, v in zip(sp, values) if v is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, color=style.COLORS[k],
                    linestyle="-" if column.startswith("heads") else "--", label=column.replace(" MiB", ""))
            drawn[(mixer, column)] = values
        ax.set_xscale("log", base=2), ax.set_yscale("log")
        ax.set_xticks(sp, [str(s) for s in sp])
        ax.set_xlabel("SP degree")
        ax.set_title(mixer)
    axes[0].set_ylabel("MiB sent per layer by the busiest rank (fwd + bwd)")
    axes[0].legend(fontsize=7)
    style.save(fig, out)
    return {"mixers": mixers, "series": drawn}


def attention_peers(pages: Mapping[str, str], out: Path) -> dict:
    """USP attention's layouts against DeepSpeed's Ulysses: time, bytes and collectives."""
    table = find(pages[ATTENTION], "configuration", "median ms", "MB sent / rank (counted)", "collectives / rank")
    rows = table.records()
    names = [re.sub(r"`", "", r["configuration"]).replace("UlyssesSPAttentionHF", "Ulysses HF") for r in rows]
    fig, axes = style.new(2.8, 3)
    drawn = {}
    for ax, (column, label) in zip(axes, [("median ms", "median ms, fwd + bwd"), ("MB sent / rank (counted)", "MB sent per rank"),
                                          ("collectives / rank", "collectives per rank")]):
        values = [number(r[column]) for r in rows]
        colors = [style.COLORS[0] if n.startswith("ours") else style.COLORS[1] for n in names]
        ax.barh(range(len(rows))[::-1], values, color=colors, height=0.6)
        for i, v in zip(range(len(rows))[::-1], values):
            ax.text(v, i, f" {v:g}", va="center", fontsize=7)
        ax.set_yticks(range(len(rows))[::-1], names if ax is axes[0] else [""] * len(rows))
        ax.set_xlim(0, max(values) * 1.3)
        ax.set_title(label)
        drawn[column] = values
    fig.suptitle("S = 4096, 16 heads, fp32, 4 gloo ranks: ours (blue) and DeepSpeed (orange)", fontsize=9)
    style.save(fig, out)
    return {"configurations": names, "series": drawn}


def hot_path(pages: Mapping[str, str], out: Path) -> dict:
    """Kernel-like ops of a patched layer over the unpatched one, per layout, with the targets."""
    table = find(pages[HOT_PATH], "layout", "kernel-like ops", "unpatched", "ratio", "target")
    rows = table.records()
    names = [r["layout"] for r in rows]
    ratio = [number(r["kernel-like ops"]) / number(r["unpatched"]) for r in rows]
    targets = [number(r["target"]) for r in rows]
    fig, ax = style.new(0.3 * len(rows) + 1.2)
    y = list(range(len(rows)))[::-1]
    ax.barh(y, ratio, color=style.COLORS[0], height=0.6, label="patched / unpatched kernel-like ops")
    ty = [(yi, t) for yi, t in zip(y, targets) if t]
    ax.scatter([t for _, t in ty], [yi for yi, _ in ty], marker="|", s=200, color=style.COLORS[4], zorder=3,
               label="target")
    for yi, r in zip(y, ratio):
        ax.text(r, yi, f" {r:.2f}×", va="center", fontsize=7)
    ax.axvline(1, color="black", lw=0.6)
    ax.set_yticks(y, names)
    ax.set_xlabel("kernel-like ops per layer, patched / unpatched (syncs: 0 per layer in every row)")
    ax.set_title("The patched layer's op count by layout and preset")
    ax.legend(fontsize=7, loc="lower right")
    style.save(fig, out)
    return {"layouts": names, "ratio": ratio, "targets": targets}


def _tolerances(markdown: str) -> dict[str, float]:
    text = " ".join(markdown.split())
    m = re.search(r"asserts loss ([\d.e-]+) absolute, `grad_norm` and parameters ([\d.e-]+) relative, metrics "
                  r"([\d.e-]+) absolute", text)
    if not m:
        raise LookupError("the sentence stating the test's tolerances is gone")
    loss, rel, metrics = (float(x) for x in m.groups())
    return {"loss, abs diff": loss, "`grad_norm`, rel diff": rel, "params, rel diff": rel, "metrics, abs diff": metrics}


def post_training(pages: Mapping[str, str], out: Path) -> dict:
    """LongRLOOTrainer against TRL's RLOOTrainer: each difference beside the test's tolerance."""
    tolerance = _tolerances(pages[POST_TRAINING])
    columns = list(tolerance)
    table = find(pages[POST_TRAINING], "mesh", "case", *columns)
    rows = table.records()
    floor = 1e-12  # a difference of exactly 0 drawn at the floor, labelled "0"
    fig, ax = style.new(3.2)
    width = 0.8 / len(rows)
    drawn = {}
    for k, r in enumerate(rows):
        values = [number(r[c]) for c in columns]
        xs = [i + (k - (len(rows) - 1) / 2) * width for i in range(len(columns))]
        ax.bar(xs, [max(v, floor) for v in values], width * 0.9, color=style.COLORS[k],
               label=f"{r['mesh']}, {re.sub('`', '', r['case'])}, max_tokens {r['max_tokens']}")
        for x, v in zip(xs, values):
            if v == 0:
                ax.text(x, floor, "0", ha="center", va="bottom", fontsize=6)
        drawn[(r["mesh"], r["case"], r["max_tokens"])] = values
    for i, c in enumerate(columns):
        ax.plot([i - 0.45, i + 0.45], [tolerance[c]] * 2, color="black", lw=1.2)
        ax.text(i + 0.45, tolerance[c], f" test's bound {tolerance[c]:g}", va="center", fontsize=6)
    ax.set_yscale("log")
    ax.set_ylim(floor, 1e-2)
    ax.set_xticks(range(len(columns)), [c.replace("`", "") for c in columns])
    ax.set_ylabel("difference from single-process TRL")
    ax.set_title("One RLOO step on 4 gloo ranks against TRL's RLOOTrainer (rank 0; bars far under the bounds)")
    ax.legend(fontsize=6, loc="upper left")
    style.save(fig, out)
    return {"columns": columns, "tolerance": tolerance, "rows": drawn}


def step_time_backtest(pages: Mapping[str, str], out: Path) -> dict:
    """The step-time model against every GPU run: modelled seconds over measured ones."""
    table = find(pages[GPU], "card", "widths", "layers", "memory", "tokens", "measured s", "model of that code s")
    rows = table.records()
    measured = [number(r["measured s"]) for r in rows]
    model = [number(r["model of that code s"]) for r in rows]
    labels = [f"{r['card']}, {r['widths']} widths x {r['layers']} layers, {r['memory']}, "
              f"{int(number(r['tokens'])) // 1024}K" for r in rows]
    fig, ax = style.new(0.3 * len(rows) + 1.2)
    y = list(range(len(rows)))[::-1]
    ax.axvspan(0.9, 1.1, color="grey", alpha=0.15, label="±10 %")
    ax.axvline(1.0, color="black", lw=0.8)
    ratio = [m / s for m, s in zip(model, measured)]
    ax.barh(y, [r - 1 for r in ratio], left=1, height=0.6,
            color=[style.COLORS[0] if r["card"] == "H200" else style.COLORS[1] for r in rows])
    for yi, r, m, s in zip(y, ratio, model, measured):
        ax.text(max(r, 1) + 0.005, yi, f" {r:.2f} (model {m:.3f} s, measured {s:.3f} s)", va="center", fontsize=7)
    ax.set_yticks(y, labels)
    ax.set_xlim(0.8, 1.3)
    ax.set_xlabel("modelled step time / measured (one GPU, forward + backward; H100 orange, H200 blue)")
    ax.set_title("The planner's step-time model against every GPU run (benchmarks/gpu_model.py --backtest)")
    ax.legend(fontsize=7, loc="lower right")
    style.save(fig, out)
    return {"measured_s": measured, "model_s": model}


def model_against_measured(pages: Mapping[str, str], out: Path) -> dict:
    """Every measured page's check of the planner in one picture: planner / measured for the
    per-token memory budget, the FSDP memory model and the step-time model."""
    budget = find(pages[MEMORY], "shape", "mode", "tokens", "device vec", "planner vec").records()
    fsdp = find(pages[MEMORY], "micro-batch counts", "measured MiB", "estimated MiB").records()
    backtest = find(pages[GPU], "card", "measured s", "model of that code s").records()
    families = [
        ("memory per token, GPU (CPU census)", [number(r["planner vec"]) / number(r["device vec"]) for r in budget]),
        ("memory per token, host (CPU census)", [number(r["planner host vec/layer"]) / number(r["host vec/layer"])
                                                 for r in budget if number(r["host vec/layer"])]),
        ("FSDP2 peak, 4 ranks (CPU)", [number(r["estimated MiB"]) / number(r["measured MiB"]) for r in fsdp]),
        ("step time (H100, H200)", [number(r["model of that code s"]) / number(r["measured s"]) for r in backtest]),
    ]
    fig, ax = style.new(2.6)
    ax.axvspan(0.9, 1.1, color="grey", alpha=0.15, label="±10 %")
    ax.axvline(1.0, color="black", lw=0.8)
    for k, (name, ratios) in enumerate(families):
        y = len(families) - 1 - k
        jitter = [y + ((i % 5) - 2) * 0.06 for i in range(len(ratios))]
        ax.scatter(ratios, jitter, s=14, color=style.COLORS[k], alpha=0.8)
        ax.text(max(ratios) + 0.01, y, f" {len(ratios)} rows, {min(ratios):.2f}–{max(ratios):.2f}", va="center", fontsize=7)
    ax.set_yticks(range(len(families))[::-1], [f for f, _ in families])
    ax.set_xlim(0.8, 1.25)
    ax.set_xlabel("the planner's figure / the measured one")
    ax.set_title("The planner against every measurement that checks it (memory and gpu pages)")
    ax.legend(fontsize=7, loc="lower right")
    style.save(fig, out)
    return {name: ratios for name, ratios in families}


# name -> (pages read, relative to docs/; the function drawing img/NAME.png)
FIGURES: dict[str, tuple[tuple[str, ...], Callable[[Mapping[str, str], Path], dict]]] = {
    "longest-context": ((LONGEST,), longest_context),
    "demo-flex": ((DEMO,), demo),
    "bf16-kernel-sets": ((BF16,), bf16_isa),
    "memory-budget": ((MEMORY,), memory_budget),
    "packing-balance": ((PLANNING,), packing_balance),
    "mixer-bytes": ((MIXERS,), mixer_bytes),
    "attention-peers": ((ATTENTION,), attention_peers),
    "hot-path-ops": ((HOT_PATH,), hot_path),
    "rloo-against-trl": ((POST_TRAINING,), post_training),
    "step-time-backtest": ((GPU,), step_time_backtest),
    "model-against-measured": ((MEMORY, GPU), model_against_measured),
}
