"""The package's size rules (docs/DESIGN.md "Style" 1): no module past 320 lines, no function
past 80 lines unless its docstring says why ("Long because ...")."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hf_longctx"
MAX_FILE_LINES = 320
MAX_FUNCTION_LINES = 80


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def long_files(paths) -> list[str]:
    return [f"{p}: {n} lines" for p in paths
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]


def long_functions(paths) -> list[str]:
    out = []
    for p in paths:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES and "Long because" not in (ast.get_docstring(node) or ""):
                    out.append(f"{p}::{node.name}: {length} lines")
    return out


def test_no_module_past_320_lines():
    assert long_files(_modules()) == []


def test_no_function_past_80_lines_without_a_reason():
    assert long_functions(_modules()) == []


def test_the_rules_see_a_long_module_and_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(90))
    bad = tmp_path / "bad.py"
    bad.write_text(f'def f():\n    """Short."""\n{body}\n' + "\n" * 240)
    why = tmp_path / "why.py"
    why.write_text(f'def f():\n    """Long because one table."""\n{body}\n')
    assert len(long_files([bad])) == 1 and long_files([why]) == []
    assert len(long_functions([bad])) == 1 and long_functions([why]) == []
