"""The documentation site as `make docs` builds it: `mkdocs build --strict` succeeds (every
build hook's check passes: docs/hooks/api_check.py, site_check.py), the API pages carry their
parameter tables and the pictured pages their generated pictures. Needs the `docs` extra
(skipped without MkDocs); about 15 s on an idle 2-core machine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers.doc_blocks import ROOT
from tests.helpers.docs_hooks import hook


def test_the_strict_build_has_the_tables_and_pictures(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert hook("site_check").problems(site, ROOT) == []
    patching = (site / "reference" / "api" / "patching" / "index.html").read_text()
    assert patching.count('doc-section-title">Parameters:') >= 8
    assert 'src="../../img/longest-context.png"' in (site / "guides" / "longest-context" / "index.html").read_text()
    assert (site / "img" / "model-coverage.png").read_bytes().startswith(b"\x89PNG")
