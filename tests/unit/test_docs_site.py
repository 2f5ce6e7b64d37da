"""The documentation site's checks that need no MkDocs: every public name has a docstring and a
place in the API reference (docs/hooks/api_check.py, which `make docs` runs as a build hook), the
API index names every public name with the page that documents it, the repository layout page
names every training package and recipe, and the command-line reference renders every
subcommand (docs/hooks/cli_reference.py)."""

from __future__ import annotations

import importlib.util
import re

import hf_longctx
from tests.helpers.doc_blocks import ROOT


def _hook(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", ROOT / "docs" / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_name_is_documented_and_referenced():
    assert _hook("api_check").problems(ROOT) == []


def test_an_undocumented_name_is_reported(monkeypatch):
    """The check above would pass on a checker that found nothing: a public class without a
    docstring, missing from the reference, with an undocumented method, gives three lines."""
    class Undocumented:
        def run(self):
            pass

    monkeypatch.setattr(hf_longctx, "Undocumented", Undocumented, raising=False)
    monkeypatch.setattr(hf_longctx, "__all__", [*hf_longctx.__all__, "Undocumented"])
    found = _hook("api_check").problems(ROOT)
    assert len(found) == 3 and all("Undocumented" in line for line in found), found
    assert any("no docstring" in line and ".run" in line for line in found), found


def test_cli_reference_has_every_subcommand():
    from hf_longctx.cli import build_parser

    text = _hook("cli_reference").render()
    subcommands = next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices).choices
    for name in ["", *subcommands]:
        assert f"## `hf-longctx{' ' + name if name else ''}`" in text, name
    assert "--gpu-memory" in text and "usage: hf-longctx plan" in text


def test_api_index_names_every_public_name_with_its_page():
    """docs/reference/api/index.md: one row per page, listing the names whose `:::` directive is
    on that page; together, exactly `hf_longctx.__all__`."""
    api = ROOT / "docs" / "reference" / "api"
    directive = _hook("api_check").DIRECTIVE
    listed: dict[str, str] = {}
    for page, names in re.findall(r"^\| \[[^]]+\]\((\w+\.md)\) \| (.+) \|$", (api / "index.md").read_text(), re.M):
        for name in re.findall(r"`(\w+)`", names):
            assert name not in listed, f"{name} is listed on {listed[name]} and {page}"
            listed[name] = page
    assert set(listed) == set(hf_longctx.__all__), (set(hf_longctx.__all__) - set(listed), set(listed) - set(hf_longctx.__all__))
    for name, page in listed.items():
        obj = getattr(hf_longctx, name)
        paths = {f"{obj.__module__}.{obj.__qualname__}", f"hf_longctx.{name}"}
        assert paths & set(directive.findall((api / page).read_text())), f"the index puts {name} on {page}, which has no '::: {obj.__module__}.{obj.__qualname__}'"


def test_layout_page_names_every_training_package_and_recipe():
    from tests.helpers.doc_blocks import blocks

    (block,) = blocks("docs/project/layout.md")
    text = block.text
    packages = sorted(p.name for p in (ROOT / "hf_longctx" / "training").iterdir() if (p / "__init__.py").is_file())
    assert packages and all(f"{p}/" in text for p in packages), [p for p in packages if f"{p}/" not in text]
    recipes = sorted(p.stem for p in (ROOT / "recipes").glob("*.py"))
    assert [r for r in recipes if not re.search(rf"\b{r}\b", text)] == []
