"""The test suite's own layout: shared test code lives in tests/helpers/, never in a test module.

A test module (`test_*.py`) is what pytest collects: importing one from another runs its
module-level code twice, registers its fixtures where they were not meant to be, and hides
from a newcomer where a helper lives. So no module under tests/ or benchmarks/ imports a
`test_*` module (checked on the parsed imports, `from tests.x import test_y` included); the
shared code sits in tests/helpers/, and the root of tests/ holds only the package marker and
conftest.py. No two test files share a name anywhere under tests/, so a name in a failure
report or a `-k` filter points at one file.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def _sources() -> list[Path]:
    return sorted([*TESTS.rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")])


def _is_test_module(dotted: str) -> bool:
    return dotted.split(".")[-1].startswith("test_")


def imports_of_test_modules(path: Path) -> list[str]:
    """`line: module` for every import in `path` that names a `test_*` module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: {a.name}" for a in node.names if _is_test_module(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if _is_test_module(node.module):
                found.append(f"{node.lineno}: {node.module}")
            else:  # `from tests.distributed import test_usp`
                found += [f"{node.lineno}: {node.module}.{a.name}" for a in node.names if _is_test_module(a.name)]
    return found


def test_no_module_imports_a_test_module():
    bad = {str(p.relative_to(ROOT)): hits for p in _sources() if (hits := imports_of_test_modules(p))}
    assert not bad, (
        "test modules import other test modules; move what they share into tests/helpers/ "
        f"(one module per concept) and import it from there: {bad}"
    )


def test_no_two_test_files_share_a_name():
    by_name = collections.defaultdict(list)
    for p in TESTS.rglob("test_*.py"):
        by_name[p.name].append(str(p.relative_to(ROOT)))
    dup = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not dup, f"test files with one name (rename each to say what it tests): {dup}"


def test_shared_test_code_lives_in_helpers():
    loose = sorted(p.name for p in TESTS.glob("*.py") if p.name not in ("__init__.py", "conftest.py"))
    assert not loose, f"modules at the root of tests/: {loose}; shared test code belongs in tests/helpers/"


def test_the_check_sees_each_kind_of_import(tmp_path):
    """The import check on a file holding each form it must catch, and one it must not."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import tests.unit.test_offload\n"
        "from tests.unit.test_offload import FakeStreams\n"
        "from tests.distributed import test_usp, helpers_like\n"
        "from tests.helpers.stub_streams import FakeStreams\n"
    )
    assert imports_of_test_modules(probe) == [
        "1: tests.unit.test_offload", "2: tests.unit.test_offload", "3: tests.distributed.test_usp",
    ]
