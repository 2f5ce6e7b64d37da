"""The documentation site's hook modules (docs/hooks/), imported as MkDocs imports them.

MkDocs loads each hook file with its folder on `sys.path` while the file runs, so a hook
imports its sibling modules (page_tables, figure_style, model_zoo) by their bare names;
`hook(name)` does the same for a test and returns the module."""

from __future__ import annotations

import importlib
import sys

from tests.helpers.doc_blocks import ROOT

HOOKS = ROOT / "docs" / "hooks"


def hook(name: str):
    """docs/hooks/NAME.py as a module (its siblings importable while it loads)."""
    if str(HOOKS) in sys.path:
        return importlib.import_module(name)
    sys.path.insert(0, str(HOOKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(HOOKS))
