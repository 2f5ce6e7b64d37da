"""MkDocs hook: the built site shows what the pages promise: parameter tables and pictures.

After the build, every object of the API reference (each `::: path` of docs/reference/api/)
whose signature takes parameters has a Parameters (or, for a dataclass of results,
Attributes) table, and a Returns table when its signature returns something; every page of
`PICTURED` shows at least one generated picture (`img/NAME.png`) whose file exists in the
site. Each problem is a warning, so `mkdocs build --strict` (`make docs`) fails on it;
`tests/unit/test_docs_site_check.py` runs `problems` on small sites, and
`tests/integration/test_docs_build.py` on the real one."""

from __future__ import annotations

import html
import logging
import re
from pathlib import Path

API_DIR = Path("docs/reference/api")
DIRECTIVE = re.compile(r"^::: *([\w.]+)", re.M)
SECTION = re.compile(r'doc-section-title">([^<:]+):?</span>')
SIGNATURE = re.compile(r'class="doc-signature[^"]*"><pre><span></span><code>(.*?)</code>', re.S)
IMAGE = re.compile(r'<img[^>]*\ssrc="([^"]*img/[\w.-]+\.png)"')
NO_VALUE = ("None", "NoReturn")
# Pages (relative to docs/) that must show a generated picture.
PICTURED = (
    "index.md",
    "guides/longest-context.md",
    "measured/index.md",
    "measured/demo.md",
    "measured/models.md",
    "measured/bf16.md",
    "measured/memory.md",
    "measured/planning.md",
    "measured/hybrid-mixers.md",
    "measured/attention.md",
    "measured/hot-path.md",
    "measured/gpu.md",
    "measured/post-training.md",
)


def _html_of(site: Path, page: str) -> Path:
    """The built file of a page (MkDocs' directory URLs: a/b.md -> a/b/index.html)."""
    stem = page.removesuffix(".md")
    return site / ("index.html" if stem == "index" else f"{stem.removesuffix('/index')}/index.html")


def _own_contents(text: str, start: int, others: list[int]) -> str:
    """An object's own HTML: from its heading to its members (`doc-children`) or the next object."""
    ends = [i for i in [text.find("doc-children", start), *others] if i > start]
    return text[start:min(ends)] if ends else text[start:]


def api_problems(site: Path, root: Path) -> list[str]:
    """Every API object with parameters but no parameter table, or a return value but no Returns table."""
    found = []
    for md in sorted((root / API_DIR).glob("*.md")):
        paths = DIRECTIVE.findall(md.read_text())
        if not paths:
            continue
        built = _html_of(site, str(md.relative_to(root / "docs")))
        text = built.read_text()
        starts = {p: text.find(f'id="{p}"') for p in paths}
        for path, start in starts.items():
            where = f"{built.relative_to(site)}: {path}"
            if start < 0:
                found.append(f"{where} is not on the page")
                continue
            own = _own_contents(text, start, [s for q, s in starts.items() if q != path])
            sig = SIGNATURE.search(own)
            signature = html.unescape(re.sub(r"<[^>]+>", "", sig.group(1))) if sig else ""
            params = re.search(r"\((.*)\)", signature, re.S)
            returns = re.search(r"\)\s*->\s*(.+?)\s*$", signature, re.S)
            sections = set(SECTION.findall(own))
            if params and params.group(1).strip() and not sections & {"Parameters", "Attributes"}:
                found.append(f"{where} takes parameters but its docstring has no Args (or Attributes) section")
            if returns and returns.group(1) not in NO_VALUE and not sections & {"Returns", "Yields"}:
                found.append(f"{where} returns {returns.group(1)} but its docstring has no Returns section")
    return found


def picture_problems(site: Path, pages: tuple[str, ...] = PICTURED) -> list[str]:
    """Every page of `pages` without a generated picture, or whose picture is missing from the site."""
    found = []
    for page in pages:
        built = _html_of(site, page)
        if not built.is_file():
            found.append(f"{page}: not built")
            continue
        sources = IMAGE.findall(built.read_text())
        if not sources:
            found.append(f"{page} shows no generated picture (img/NAME.png)")
        for src in sources:
            if not (built.parent / src).resolve().is_file():
                found.append(f"{page}: {src} is not in the site")
    return found


def problems(site: Path, root: Path) -> list[str]:
    """Every missing parameter table or picture of the built site, one line each."""
    return api_problems(site, root) + picture_problems(site)


def on_post_build(config, **kwargs) -> None:
    log = logging.getLogger("mkdocs.hooks.site_check")
    for line in problems(Path(config.site_dir), Path(config.config_file_path).parent):
        log.warning(line)
