"""The constraints files (tools/lock.py): a fresh clone installs what the suite last passed with.

Each lock pins exact releases of every package it names, the core ones included, and never
torch (TORCH_SPEC / FLOOR_SPEC picks that build); every Makefile rule that installs into the
project's venvs passes its lock to pip; and the environment running this suite, when it is one of
those venvs, holds exactly its lock's releases (a venv left from an older lock fails here, naming
each package, instead of testing something no fresh clone installs).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tools.lock import canonical, differences, installed, read

ROOT = Path(__file__).resolve().parents[2]
LOCKS = {"main": "constraints/main.txt", "floor": "constraints/floor.txt", "t517": "constraints/transformers-5.17.txt"}
CORE = {"main": ("transformers", "accelerate", "datasets", "peft", "trl", "huggingface-hub", "tokenizers", "pytest"),
        "floor": ("transformers", "accelerate", "datasets", "peft", "trl", "huggingface-hub", "tokenizers", "pytest"),
        "t517": ("transformers", "huggingface-hub", "tokenizers")}


@pytest.mark.parametrize("name", sorted(LOCKS))
def test_each_lock_pins_exact_releases_and_no_torch(name):
    pins = read(str(ROOT / LOCKS[name]))
    assert all(p in pins for p in CORE[name]), sorted(set(CORE[name]) - set(pins))
    assert not {p for p in pins if p == "torch" or p.startswith("nvidia-")}
    header = (ROOT / LOCKS[name]).read_text().splitlines()[:3]
    assert re.search(r"Written \d{4}-\d\d-\d\d by tools/lock.py on CPython", header[1]), header


def test_read_refuses_what_is_not_an_exact_pin(tmp_path):
    bad = tmp_path / "lock.txt"
    bad.write_text("# a comment\nnumpy==2.4.6\ntransformers>=5.19\n")
    with pytest.raises(ValueError, match=r"lock.txt:3: 'transformers>=5.19' is not name==version"):
        read(str(bad))


def test_differences_name_every_changed_package():
    assert canonical("Jinja2") == canonical("jinja2") and canonical("typing_extensions") == "typing-extensions"
    got = differences({"a": "1", "b": "2", "c": "3"}, {"a": "1", "b": "2.1", "d": "4"})
    assert got == [("b", "2", "2.1"), ("c", "3", "-"), ("d", "-", "4")]


def test_every_install_rule_passes_its_lock():
    make = (ROOT / "Makefile").read_text()
    assert "LOCK ?= constraints/main.txt" in make and "PIN = $(if $(LOCK),-c $(LOCK))" in make
    assert "FLOOR_LOCK ?= constraints/floor.txt" in make and "T517_LOCK ?= constraints/transformers-5.17.txt" in make
    installs = [ln.strip() for ln in make.splitlines() if "pip install" in ln and "LATEST_VENV" not in ln]
    unpinned = [ln for ln in installs if not any(k in ln for k in ("$(PIN)", "FLOOR_LOCK", "T517_LOCK", "$(SYSTEM_NEEDS)"))]
    assert not unpinned, unpinned


def test_this_venv_holds_its_lock():
    """Run by `make test` in .venv (main.txt) and by `make test-floor` in .venv-floor (floor.txt);
    elsewhere (your own environment, `make test-latest`, the 5.17 overlay) there is nothing to hold."""
    prefix = Path(sys.prefix).resolve()
    lock = {ROOT / ".venv": "main", ROOT / ".venv-floor": "floor"}.get(prefix)
    if lock is None or ".floor-transformers-5.17" in os.environ.get("PYTHONPATH", ""):
        pytest.skip(f"{prefix} is not a venv the Makefile builds from a lock")
    changed = held_against(read(str(ROOT / LOCKS[lock])), installed(sys.executable), CORE[lock])
    assert not changed, f"{prefix} differs from {LOCKS[lock]} (rebuild it: make clean, then make test): {changed}"


def held_against(locked: dict[str, str], now: dict[str, str], core) -> list[tuple[str, str, str]]:
    """What breaks a venv's hold on its lock: a package at another release, one the lock does not
    name, a core one missing. A locked package that is absent is an extra not installed yet (`make
    test` installs `[test,peft]`; the docs extra arrives with `make docs`, after it, in CI)."""
    return [(n, old, new) for n, old, new in differences(locked, now) if new != "-" or n in core]


def test_the_hold_allows_an_extra_not_installed_and_nothing_else():
    locked = {"transformers": "5.25.0", "mkdocs": "1.6.1", "numpy": "2.4.6"}
    assert held_against(locked, {"transformers": "5.25.0", "numpy": "2.4.6"}, CORE["main"]) == []
    assert held_against(locked, {"numpy": "2.4.6"}, CORE["main"]) == [("transformers", "5.25.0", "-")]
    assert held_against(locked, {"transformers": "5.25.0", "numpy": "2.5.0", "x": "1"}, CORE["main"]) == [
        ("numpy", "2.4.6", "2.5.0"), ("x", "-", "1")]
