"""The site's generated pictures: each is drawn from the source its page's table prints, and
every page shows the pictures the build makes (docs/hooks/figures.py, figures_pages.py,
figures_results.py).

A page figure reads the table of its page (`page_tables.find`), so its numbers are the
table's; here each one is drawn from the pages as committed (a renamed column fails it, as it
fails the build) and what it drew is compared with the table's cells. A results figure reads
benchmarks/results/ (the model zoo, the H200 throughput rows) and is compared with the files.
The longest-context page, the home page and every measured page show a picture
(`site_check.PICTURED`); every picture a page shows is one the build draws."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from tests.helpers.doc_blocks import ROOT
from tests.helpers.docs_hooks import hook

DOCS = ROOT / "docs"
PNG = b"\x89PNG\r\n\x1a\n"
PLANNER_FIGURES = ("plan-load", "plan-load-flex", "memory-per-token", "mesh")  # figures.py's own


@pytest.fixture(scope="module", autouse=True)
def agg():
    import matplotlib

    matplotlib.use("Agg")


def _pages(names) -> dict[str, str]:
    return {name: (DOCS / name).read_text() for name in names}


@pytest.mark.parametrize("name", sorted(hook("figures_pages").FIGURES))
def test_each_page_figure_draws_from_its_table(name, tmp_path):
    pages, draw = hook("figures_pages").FIGURES[name]
    drawn = draw(_pages(pages), tmp_path / f"{name}.png")
    assert (tmp_path / f"{name}.png").read_bytes().startswith(PNG)
    assert drawn and all(v not in (None, [], {}) for v in drawn.values()), drawn


def test_the_longest_context_figure_is_the_table(tmp_path):
    tables = hook("page_tables")
    figures = hook("figures_pages")
    markdown = (DOCS / figures.LONGEST).read_text()
    drawn = figures.longest_context({figures.LONGEST: markdown}, tmp_path / "longest.png")
    table = tables.find(markdown, "planner's longest", "published")
    assert [round(x, 2) for x in drawn["planner_M"]] == [float(c.rstrip("M")) for c in table.column("planner's longest")]
    anchors = [a for a in drawn["published"] if a]
    assert ("ALST", 500 * 2**10) in anchors and ("FPDT", 2 * 2**20) in anchors, anchors
    assert len(anchors) == sum(c != "—" for c in table.column("published"))


def test_the_packing_and_post_training_figures_are_their_tables(tmp_path):
    tables = hook("page_tables")
    figures = hook("figures_pages")
    planning = (DOCS / figures.PLANNING).read_text()
    drawn = figures.packing_balance({figures.PLANNING: planning}, tmp_path / "packing.png")
    rows = tables.find(planning, "distribution", "strategy", "synced / ideal").records()
    balanced = [float(re.search(r"[\d.]+", r["synced / ideal"]).group(0)) for r in rows if "balanced" in r["strategy"]]
    assert drawn["means"]["balanced"] == balanced
    post = (DOCS / figures.POST_TRAINING).read_text()
    drawn = figures.post_training({figures.POST_TRAINING: post}, tmp_path / "post.png")
    assert drawn["tolerance"] == {"loss, abs diff": 1e-6, "`grad_norm`, rel diff": 1e-4, "params, rel diff": 1e-4,
                                  "metrics, abs diff": 1e-5}
    table = tables.find(post, "mesh", "case", "loss, abs diff")
    assert [v[0] for v in drawn["rows"].values()] == [tables.number(c) for c in table.column("loss, abs diff")]


def test_the_results_figures_are_the_committed_files(tmp_path):
    from benchmarks.zoo import overall

    figures = hook("figures_results")
    kinds = figures.model_coverage(ROOT, tmp_path / "coverage.png")
    zoo = json.loads((ROOT / "benchmarks/results/zoo.json").read_text())
    assert {v: n for v, n in kinds["causal LMs"].items() if n} == dict(Counter(overall(r) for r in zoo))
    assert sum(kinds["image-text-to-text"].values()) == len(json.loads((ROOT / "benchmarks/results/vlm_zoo.json").read_text()))
    drawn = figures.gpu_throughput(ROOT, tmp_path / "throughput.png")
    for r in json.loads((ROOT / figures.THROUGHPUT).read_text()):
        if "profile" not in r:
            want = r["tokens"] / r["seconds"] if r.get("fits") else None
            assert drawn[("tokens/s", r["preset"], r["tokens"])] == want, r


def test_every_picture_a_page_shows_is_drawn_and_the_pages_show_them():
    names = set(PLANNER_FIGURES) | set(hook("figures_pages").FIGURES) | set(hook("figures_results").FIGURES)
    shown: dict[str, set[str]] = {}
    for page in DOCS.rglob("*.md"):
        for name in re.findall(r"\]\((?:\.\./)*img/([\w-]+)\.png\)", page.read_text()):
            shown.setdefault(name, set()).add(str(page.relative_to(DOCS)))
    assert set(shown) - names == set(), "pages show pictures the build does not draw"
    assert names - set(shown) == set(), "the build draws pictures no page shows"
    pictured = {p for pages in shown.values() for p in pages}
    missing = [p for p in hook("site_check").PICTURED if p not in pictured]
    assert not missing, missing
    assert {str(p.relative_to(DOCS)) for p in (DOCS / "measured").glob("*.md")} <= set(hook("site_check").PICTURED)


def test_page_tables_read_cells_as_pages_write_them():
    tables = hook("page_tables")
    cases = {"**1.055** (1.079)": 1.055, "6,560 (1.19×)": 6560, "−2.3 %": -2.3, "1.85e-07": 1.85e-7, "—": None,
             "`[4] [2+2]`": 4, "*lower bound*": None}
    assert {c: tables.number(c) for c in cases} == cases
    assert tables.number("27.00M", suffixes=True) == 27 * 2**20 and tables.number("500K", suffixes=True) == 500 * 2**10
    md = "# t\n\n```text\n| not | a table |\n|---|---|\n```\n\n| a | b |\n|---|--:|\n| 1 | x \\| y |\n"
    (table,) = tables.tables(md)
    assert table.header == ("a", "b") and table.rows == (("1", "x \\| y"),) and table.heading == "t"

