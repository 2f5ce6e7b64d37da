"""The figures drawn from the committed results files: model coverage and GPU throughput.

Where it sits: docs/hooks/figures.py calls every entry of `FIGURES` while the site builds;
each reads benchmarks/results/ as committed (the model zoo through docs/hooks/model_zoo.py,
the H200 throughput rows of benchmarks/gpu_throughput.py) and draws one PNG, so a
re-measured file redraws its picture. Each function returns the numbers it drew
(tests/unit/test_docs_figures.py compares them with the files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import figure_style as style
import model_zoo

THROUGHPUT = Path("benchmarks/results/gpu_throughput_8b_h200.json")


def model_coverage(root: Path, out: Path) -> dict:
    """Model types of transformers by verdict: every causal LM and every image-text-to-text model."""
    kinds = {"causal LMs": model_zoo.counts(model_zoo.causal(root)),
             "image-text-to-text": model_zoo.counts(model_zoo.vision(root))}
    colors = dict(zip(model_zoo.VERDICTS, (style.COLORS[2], style.COLORS[7], style.COLORS[4], style.COLORS[3], "#bdbdbd")))
    fig, ax = style.new(1.9)
    seen = set()
    for y, (kind, count) in enumerate(reversed(list(kinds.items()))):
        left, total = 0, sum(count.values())
        for verdict, n in count.items():
            if n:
                ax.barh(y, n, left=left, color=colors[verdict], height=0.6, label=None if verdict in seen else verdict)
                seen.add(verdict)
                if n >= 10:
                    ax.text(left + n / 2, y, f"{verdict} {n}", ha="center", va="center", fontsize=7, color="white")
                left += n
        ax.text(total, y, "  " + ", ".join(f"{n} {v}" for v, n in count.items() if n and n < 10) + f"  ({total} in all)"
                if any(0 < n < 10 for n in count.values()) else f"  ({total} in all)", va="center", fontsize=7)
    ax.set_yticks(range(len(kinds)), list(reversed(list(kinds))))
    ax.set_xlim(0, max(sum(c.values()) for c in kinds.values()) * 1.25)
    ax.set_xlabel("model types of transformers (benchmarks/results/zoo.json, vlm_zoo.json)")
    ax.set_title("Every model type through patch(): exact against the unpatched model, or refused with the cause")
    ax.legend(fontsize=7, loc="lower right", ncol=len(seen))
    style.save(fig, out)
    return kinds


def gpu_throughput(root: Path, out: Path) -> dict:
    """Tokens/s and peak memory of one H200 by memory preset and length (Llama-3.1-8B widths)."""
    rows = [r for r in json.loads((root / THROUGHPUT).read_text()) if "profile" not in r]
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    lengths = sorted({r["tokens"] for r in rows})
    fig, axes = style.new(3.0, 2)
    width = 0.8 / len(lengths)
    drawn = {}
    for ax, (what, value, label) in zip(axes, [("tokens/s", lambda r: r["tokens"] / r["seconds"], "tokens/s (fwd + bwd)"),
                                               ("peak GiB", lambda r: r["peak_gib"], "peak GiB")]):
        for k, tokens in enumerate(lengths):
            xs, ys = [], []
            for i, preset in enumerate(presets):
                row = next((r for r in rows if r["preset"] == preset and r["tokens"] == tokens), None)
                x = i + (k - (len(lengths) - 1) / 2) * width
                if row is None:
                    continue
                if not row.get("fits"):
                    ax.text(x, 0, "out of\nmemory", ha="center", va="bottom", fontsize=6, color=style.COLORS[4])
                    drawn[(what, preset, tokens)] = None
                    continue
                xs.append(x), ys.append(value(row))
                drawn[(what, preset, tokens)] = value(row)
            ax.bar(xs, ys, width * 0.9, color=style.COLORS[k], label=f"{tokens // 1024}K tokens")
            for x, y in zip(xs, ys):
                ax.text(x, y, f"{y:,.0f}" if what == "tokens/s" else f"{y:.1f}", ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(presets)), presets)
        ax.set_ylabel(label)
        ax.set_title(f"{label} by memory preset")
        ax.legend(fontsize=7)
    fig.suptitle("One H200, Llama-3.1-8B widths (2 layers), one document, bf16 (benchmarks/results/"
                 f"{THROUGHPUT.name})", fontsize=9)
    style.save(fig, out)
    return drawn


# name -> the function drawing img/NAME.png from the repository root's results files
FIGURES: dict[str, Callable[[Path, Path], dict]] = {
    "model-coverage": model_coverage,
    "gpu-throughput": gpu_throughput,
}
