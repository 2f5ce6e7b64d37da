"""Every code block of README.md and the documentation pages is run by a named test or says
why it is not (`tests/helpers/doc_blocks.py` has the markers). A `tested:` marker must name a
test function that exists and whose file names the page (the test parses the block from it);
an `illustrative:` marker must give a reason."""

from __future__ import annotations

import re

from tests.helpers.doc_blocks import ROOT, blocks, pages


def test_every_block_is_tested_or_says_why_not():
    bad = []
    for page in pages():
        for b in blocks(page):
            where = f"{b.page}:{b.line}"
            if b.kind is None:
                bad.append(f"{where}: no '<!-- tested: tests/...::test_x -->' or '<!-- illustrative: why -->' "
                           f"on the line before the fence")
            elif b.kind == "illustrative" and len(b.note) < 10:
                bad.append(f"{where}: the illustrative marker needs a reason, got {b.note!r}")
            for test_id in b.tests:
                path, _, name = test_id.partition("::")
                source = ROOT / path
                if not source.is_file() or not re.search(rf"^def {re.escape(name)}\(", source.read_text(), re.M):
                    bad.append(f"{where}: {test_id} is not a test function")
                elif b.page not in source.read_text():
                    bad.append(f"{where}: {path} does not name {b.page} (it must parse the block from the page)")
    assert not bad, "\n".join(bad)


def test_the_rule_sees_blocks_and_markers(tmp_path, monkeypatch):
    """The parser finds a fence and its marker, and reports an unmarked block (the check above
    would pass on a parser that saw nothing)."""
    import tests.helpers.doc_blocks as doc_blocks

    page = tmp_path / "README.md"
    page.write_text("# t\n\n<!-- illustrative: a shell session -->\n```bash\nls\n```\n\n```python\nx = 1\n```\n")
    monkeypatch.setattr(doc_blocks, "ROOT", tmp_path)
    found = doc_blocks.blocks("README.md")
    assert [(b.kind, b.lang, b.text) for b in found] == [("illustrative", "bash", "ls\n"), (None, "python", "x = 1\n")]
