"""MkDocs hook: the site's figures, drawn at build time by the project's own code.

Each figure is a generated file of the site (nothing is written into docs/), so a page's
picture always shows what the installed code computes or what the page's own table prints:
- img/plan-load.png, img/plan-load-flex.png: `hf-longctx plan ... --plot` itself (the per-rank
  load of one sampled step for the suggested setting; with `--flex`, flexible SP groups);
- img/memory-per-token.png: the planner's per-token budget by `patch(memory=...)` preset
  (`capacity/budget.step_budget`, the model the CPU census holds within 0-5 %);
- img/mesh.png: the rank order of the mesh and which SP rank holds which token of a document
  (`layout.local_indices`, the permutation `shard_batch` applies);
- docs/hooks/figures_pages.py's figures: each drawn from the table of the page that shows it
  (the measured pages, the longest-context guide), so picture and table agree;
- docs/hooks/figures_results.py's figures: drawn from the committed results files
  (benchmarks/results/: the model zoo, the H200 throughput rows).
The commands and settings are constants below, quoted on the pages under each picture."""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path

import figures_pages
import figures_results

LLAMA_8B = "tests/data/llama-3.1-8b-config.json"
PLAN = ["plan", "--model", LLAMA_8B, "--gpu-memory", "80GiB"]
PLAN_LOAD = PLAN + ["--gpus", "32", "--host-memory", "1TiB", "--seq-len", "65536"]
PLAN_FLEX = PLAN + ["--gpus", "8", "--host-memory", "512GiB", "--seq-len", "32768", "--flex"]
PRESETS = [("off", 1), ("balanced", 1), ("high", 1), ("max", 1), ("high", 8), ("max", 8)]
BUDGET_TOKENS, BUDGET_ULYSSES = 131072, 8
LAYOUTS = [("ring 2 x ulysses 2", dict(ring=2, ulysses=2, fpdt_chunks=1)),
           ("ulysses 4", dict(ring=1, ulysses=4, fpdt_chunks=1)),
           ("ulysses 2, FPDT 2 chunks", dict(ring=1, ulysses=2, fpdt_chunks=2))]


def _plan_figure(root: Path, argv: list[str], out: Path) -> None:
    from hf_longctx.cli import main

    argv = [str(root / a) if a == LLAMA_8B else a for a in argv]
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(argv + ["--top", "1", "--plot", str(out)])
    if code != 0:
        raise RuntimeError(f"hf-longctx {' '.join(argv)} exited {code}")


def _memory_figure(root: Path, out: Path) -> None:
    import json

    import matplotlib.pyplot as plt
    from transformers import LlamaConfig

    from hf_longctx.capacity.budget import step_budget
    from hf_longctx.capacity.search import preset_setting
    from hf_longctx.data.model_dims import ModelDims

    dims = ModelDims.from_config(LlamaConfig(**json.loads((root / LLAMA_8B).read_text())))
    local = BUDGET_TOKENS / BUDGET_ULYSSES
    rows = []
    for memory, chunks in PRESETS:
        b = step_budget(dims, preset_setting(BUDGET_ULYSSES, 1, chunks, memory, dims), tokens=BUDGET_TOKENS)
        rows.append((f"{memory}" + (f"\nFPDT {chunks}" if chunks > 1 else ""), b.device / local / 1024, b.host / local / 1024))
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r[1] for r in rows], 0.4, label="GPU, above the weights")
    ax.bar([i + 0.2 for i in x], [r[2] for r in rows], 0.4, label="host (pinned), all layers")
    for i, (_, dev, host) in enumerate(rows):
        ax.text(i - 0.2, dev, f"{dev:,.0f}", ha="center", va="bottom", fontsize=7)
        ax.text(i + 0.2, max(host, 10), f"{host:,.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(x), [r[0] for r in rows])
    ax.set_yscale("log")
    ax.set_ylim(10, 4 * max(max(r[1], r[2]) for r in rows))
    ax.set_ylabel("KiB per token of the rank")
    ax.set_title(f"planner's memory per token by preset: Llama-3.1-8B, bf16, Ulysses {BUDGET_ULYSSES}, "
                 f"{BUDGET_TOKENS // 1024}K tokens", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _mesh_figure(out: Path) -> None:
    import matplotlib.pyplot as plt

    from hf_longctx.layout import local_indices

    fig, (grid, docs) = plt.subplots(2, 1, figsize=(9, 5.2), gridspec_kw={"height_ratios": [1, 1.3]})
    colors = plt.get_cmap("tab10").colors
    dp, ring, uly = 2, 2, 2  # world = dp x ring x ulysses, ulysses innermost (docs/DESIGN.md "Process groups")
    for rank in range(dp * ring * uly):
        d, r, u = rank // (ring * uly), rank // uly % ring, rank % uly
        sp_rank = r * uly + u
        grid.add_patch(plt.Rectangle((sp_rank, dp - 1 - d), 0.92, 0.85, color=colors[sp_rank], alpha=0.35))
        grid.text(sp_rank + 0.46, dp - 1 - d + 0.42, f"rank {rank}\ndp {d} · ring {r} · ulysses {u}",
                  ha="center", va="center", fontsize=8)
    grid.set_xlim(0, ring * uly), grid.set_ylim(0, dp), grid.axis("off")
    grid.set_title("init_sequence_parallel(ulysses_degree=2, ring_degree=2) on 8 ranks: dp = 8 / 4 = 2 SP groups "
                   "(one row each)", fontsize=9)
    n = 16
    for row, (name, kw) in enumerate(LAYOUTS):
        sp = kw["ring"] * kw["ulysses"]
        for sp_rank in range(sp):
            held = local_indices([0, n], ring_rank=sp_rank // kw["ulysses"], ulysses_rank=sp_rank % kw["ulysses"], **kw)
            for pos in held.tolist():
                docs.add_patch(plt.Rectangle((pos, -row), 0.95, 0.8, color=colors[sp_rank], alpha=0.6))
                docs.text(pos + 0.47, -row + 0.4, str(sp_rank), ha="center", va="center", fontsize=7)
        docs.text(-0.3, -row + 0.4, name, ha="right", va="center", fontsize=8)
    docs.set_xlim(-5.5, n), docs.set_ylim(-len(LAYOUTS) + 0.8, 1.1), docs.axis("off")
    docs.set_title(f"which SP rank holds each token of one {n}-token document (shard_batch's permutation; SP rank = "
                   "ring rank x ulysses + ulysses rank)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def on_files(files, config, **kwargs):
    import matplotlib

    matplotlib.use("Agg")
    from mkdocs.structure.files import File

    root = Path(config.config_file_path).parent
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        _plan_figure(root, PLAN_LOAD, tmp / "plan-load.png")
        _plan_figure(root, PLAN_FLEX, tmp / "plan-load-flex.png")
        _memory_figure(root, tmp / "memory-per-token.png")
        _mesh_figure(tmp / "mesh.png")
        docs = Path(config.docs_dir)
        for name, (pages, draw) in figures_pages.FIGURES.items():
            draw({page: (docs / page).read_text() for page in pages}, tmp / f"{name}.png")
        for name, draw in figures_results.FIGURES.items():
            draw(root, tmp / f"{name}.png")
        for png in sorted(tmp.glob("*.png")):
            files.append(File.generated(config, f"img/{png.name}", content=png.read_bytes()))
    return files
