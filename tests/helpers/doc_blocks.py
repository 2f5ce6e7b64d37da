"""The fenced code blocks of README.md and the documentation pages, with the marker before each.

Every block of README.md and docs/**/*.md (docs/DESIGN.md aside: the design document's blocks
are diagrams, not instructions) carries an HTML comment on the line before its fence, invisible
on the page:
    <!-- tested: tests/path/test_file.py::test_name -->   a named test runs this block, parsed
                                                           from the page (several ids: ", ")
    <!-- illustrative: the reason it is not run -->
`tests/unit/test_doc_blocks.py` holds every block to that rule; a test that runs blocks takes
them with `blocks_run_by(page, test_id)`, so the page and the test cannot drift apart."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")
MARKER = re.compile(r"^<!--\s*(tested|illustrative):\s*(.*?)\s*-->\s*$")
EXCLUDED = {"docs/DESIGN.md"}


@dataclass(frozen=True)
class Block:
    page: str  # path relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    kind: str | None  # "tested", "illustrative", or None (no marker)
    note: str  # the test ids (comma-separated) or the reason

    @property
    def tests(self) -> list[str]:
        return [t.strip() for t in self.note.split(",") if t.strip()] if self.kind == "tested" else []


def pages() -> list[str]:
    """README.md and every page under docs/ that the rule covers, relative to the root."""
    docs = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))
    return ["README.md"] + [p for p in docs if p not in EXCLUDED]


def blocks(page: str) -> list[Block]:
    """Every fenced block of `page`, in order, with the marker on the line before its fence."""
    lines = (ROOT / page).read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, start = m.group(1), i
        i += 1
        while i < len(lines) and not lines[i].startswith(fence):
            i += 1
        marker = MARKER.match(lines[start - 1]) if start > 0 else None
        found.append(Block(page, start + 1, m.group(2), "\n".join(lines[start + 1:i]) + "\n",
                           marker.group(1) if marker else None, marker.group(2) if marker else ""))
        i += 1
    return found


def blocks_run_by(page: str, test_id: str) -> list[Block]:
    """The blocks of `page` whose marker names `test_id` ("tests/...py::test_name"); at least one."""
    chosen = [b for b in blocks(page) if test_id in b.tests]
    assert chosen, f"no block of {page} is marked '<!-- tested: {test_id} -->'"
    return chosen
