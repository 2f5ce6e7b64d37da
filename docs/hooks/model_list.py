"""MkDocs hook: the model-coverage page's counts and searchable model lists, generated from
the committed zoo results.

A page line `<!-- model-counts: causal -->` (or `vision`) becomes the table of model types per
verdict, and `<!-- model-list: causal -->` (or `vision`) a filter box over one table row per
model type: its verdict and the cause (the refusal's message, why it was skipped, or the worst
error when exact), read from benchmarks/results/zoo.json and vlm_zoo.json through
docs/hooks/model_zoo.py. A re-measured file changes the page without an edit; Material's
search indexes every row, and docs/javascripts/table-filter.js filters the rows as one
types. A marker naming no list is a warning (a failure under `--strict`)."""

from __future__ import annotations

import html
import logging
import re
from pathlib import Path

import model_zoo

MARKER = re.compile(r"<!-- model-(counts|list): (\w+) -->")
LISTS = {"causal": model_zoo.causal, "vision": model_zoo.vision}


def _cell(text: str) -> str:
    """Text safe in one Markdown table cell."""
    text = " ".join(text.split())
    return html.escape(text, quote=False).replace("|", "\\|").replace("*", "\\*")


def counts_table(models: list[model_zoo.Model]) -> str:
    """| verdict | model types |, every verdict (a zero included), then the total."""
    lines = ["| verdict | model types |", "|---|---:|"]
    lines += [f"| {v} | {n} |" for v, n in model_zoo.counts(models).items()]
    lines.append(f"| all | {len(models)} |")
    return "\n".join(lines)


def list_table(models: list[model_zoo.Model], name: str) -> str:
    """The filter box and one row per model type."""
    box = (f'<div class="table-filter-box"><input class="table-filter" type="search" data-list="{name}" '
           f'placeholder="Filter: a model type, a verdict or a word of the cause" aria-label="Filter the model list">'
           '<span class="table-filter-count"></span></div>')
    lines = [box, "", "| model type | verdict | cause, or the worst error when exact |", "|---|---|---|"]
    lines += [f"| `{m.model_type}` | {m.verdict} | {_cell(m.cause)} |" for m in models]
    return "\n".join(lines)


def render(markdown: str, root: Path) -> tuple[str, list[str]]:
    """`markdown` with every marker replaced, and the markers that name no list."""
    unknown = []

    def replace(m: re.Match) -> str:
        what, name = m.groups()
        if name not in LISTS:
            unknown.append(m.group(0))
            return m.group(0)
        models = LISTS[name](root)
        return counts_table(models) if what == "counts" else list_table(models, name)

    return MARKER.sub(replace, markdown), unknown


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    if "<!-- model-" not in markdown:
        return markdown
    out, unknown = render(markdown, Path(config.config_file_path).parent)
    for marker in unknown:
        logging.getLogger("mkdocs.hooks.model_list").warning(f"{page.file.src_uri}: {marker} names no list ({sorted(LISTS)})")
    return out
