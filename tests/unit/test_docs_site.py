"""The documentation site's checks that need no MkDocs: every public name has a docstring and a
place in the API reference (docs/hooks/api_check.py, which `make docs` runs as a build hook), and
the command-line reference renders every subcommand (docs/hooks/cli_reference.py)."""

from __future__ import annotations

import importlib.util

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
