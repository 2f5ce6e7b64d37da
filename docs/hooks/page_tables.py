"""The Markdown tables of a documentation page, read as data.

A figure drawn from a measured page takes its numbers from the table the page prints (the
command's output, pasted with its date and machine), so the picture and the table can never
disagree: `find(markdown, *columns)` returns the first table whose header holds those columns,
and `number(cell)` reads a cell as the page writes it ("**1.055** (1.079)", "6,560 (1.19×)",
"−2.3 %", "27.00M", "1.85e-07"). Used by docs/hooks/figures_pages.py and the tests that hold a
page's table to the command that printed it."""

from __future__ import annotations

import re
from dataclasses import dataclass

_ROW = re.compile(r"^\|(.*)\|\s*$")
_RULE = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_SUFFIX = {"K": 2**10, "M": 2**20}


@dataclass(frozen=True)
class Table:
    """One Markdown table: its header cells, its body rows (cells as written, stripped) and the
    last heading above it."""

    heading: str
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]

    def column(self, name: str) -> list[str]:
        """The cells of the column headed `name`, top to bottom."""
        i = self.header.index(name)
        return [row[i] if i < len(row) else "" for row in self.rows]

    def records(self) -> list[dict[str, str]]:
        """Each body row as {header cell: cell}."""
        return [dict(zip(self.header, row)) for row in self.rows]


def _cells(line: str) -> tuple[str, ...]:
    inner = _ROW.match(line).group(1)
    return tuple(c.strip() for c in re.split(r"(?<!\\)\|", inner))


def tables(markdown: str) -> list[Table]:
    """Every table of a page, in order (fenced code blocks skipped)."""
    found, heading, fenced = [], "", False
    lines = markdown.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif not fenced and _ROW.match(line) and i + 1 < len(lines) and _RULE.match(lines[i + 1]):
            header, rows, i = _cells(line), [], i + 2
            while i < len(lines) and _ROW.match(lines[i]):
                rows.append(_cells(lines[i]))
                i += 1
            found.append(Table(heading, header, tuple(rows)))
            continue
        i += 1
    return found


def find(markdown: str, *columns: str) -> Table:
    """The first table whose header holds every one of `columns`; LookupError naming them."""
    for table in tables(markdown):
        if all(c in table.header for c in columns):
            return table
    raise LookupError(f"no table with the columns {list(columns)}")


def number(cell: str, *, suffixes: bool = False) -> float | None:
    """The first number of a cell as the page writes it (thousands commas, bold or italic
    marks, a unicode minus, a trailing ×, % or unit), or None when the cell holds none.
    `suffixes`: a K or M right after the number scales it by 2^10 or 2^20 (token counts)."""
    text = cell.replace("−", "-").replace("*", "").replace("`", "")
    m = _NUMBER.search(text)
    if not m:
        return None
    value = float(m.group(0).replace(",", ""))
    if suffixes and m.end() < len(text) and text[m.end()] in _SUFFIX:
        value *= _SUFFIX[text[m.end()]]
    return value
