"""docs/hooks/site_check.py, the build's check that the site shows parameter tables and
pictures, on small hand-made sites: a check that found nothing would pass the real build too,
so each kind of problem is made once and must be reported (the real site:
tests/integration/test_docs_build.py, and `make docs`, where a problem fails the build)."""

from __future__ import annotations

from tests.helpers.docs_hooks import hook

SIGNATURE = ('<div class="doc-signature highlight"><pre><span></span><code><span class="nf">{name}</span>'
             '<span class="p">(</span><span class="n">x</span><span class="p">)</span> <span class="o">-&gt;</span> '
             '<span class="nb">int</span></code></pre></div>')
TABLE = '<p><span class="doc-section-title">{title}:</span></p><table><tr class="doc-section-item"></tr></table>'


def _api_site(tmp_path, sections: dict[str, list[str]]):
    root, site = tmp_path / "repo", tmp_path / "site"
    (root / "docs" / "reference" / "api").mkdir(parents=True)
    (root / "docs" / "reference" / "api" / "things.md").write_text("".join(f"::: pkg.{n}\n\n" for n in sections))
    body = "".join(f'<h2 id="pkg.{n}" class="doc doc-heading">{n}</h2>' + SIGNATURE.format(name=n)
                   + '<div class="doc doc-contents first">' + "".join(TABLE.format(title=t) for t in titles)
                   + '<div class="doc doc-children"><p><span class="doc-section-title">Parameters:</span></p></div></div>'
                   for n, titles in sections.items())
    (site / "reference" / "api" / "things").mkdir(parents=True)
    (site / "reference" / "api" / "things" / "index.html").write_text(f"<html><body>{body}</body></html>")
    return site, root


def test_an_object_without_its_tables_is_reported(tmp_path):
    check = hook("site_check")
    site, root = _api_site(tmp_path, {"documented": ["Parameters", "Returns"], "bare": [], "no_returns": ["Parameters"]})
    found = check.api_problems(site, root)
    assert len(found) == 3, found
    assert [line for line in found if "pkg.documented" in line] == []
    assert sum("pkg.bare" in line for line in found) == 2  # no Args, no Returns (a member's table does not count)
    assert any("pkg.no_returns" in line and "Returns" in line for line in found)


def test_a_page_without_its_picture_is_reported(tmp_path):
    check = hook("site_check")
    site = tmp_path / "site"
    for page, html in {"index.html": '<img alt="x" src="img/a.png" />', "shown/index.html": '<img src="../img/a.png">',
                       "bare/index.html": "<p>no picture</p>", "broken/index.html": '<img src="../img/gone.png">'}.items():
        (site / page).parent.mkdir(parents=True, exist_ok=True)
        (site / page).write_text(html)
    (site / "img").mkdir()
    (site / "img" / "a.png").write_bytes(b"png")
    found = check.picture_problems(site, ("index.md", "shown.md", "bare.md", "broken.md", "missing.md"))
    assert found == ["bare.md shows no generated picture (img/NAME.png)", "broken.md: ../img/gone.png is not in the site",
                     "missing.md: not built"], found
