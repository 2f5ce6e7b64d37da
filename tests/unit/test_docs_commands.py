"""The shell commands of the pages that run cheaply, run from the page: every `make` line of a
block marked for `test_make_lines_name_real_targets` is dry-run (`make -n`, so the target and
its variables exist and parse), the `hf-longctx plan` commands of the planner and GRPO guides
print the suggestion the page shows in the block after each, and the DPO guide's `--task dpo`
command suggests what its sentence says (`tests/helpers/doc_blocks.py`)."""

from __future__ import annotations

import shlex
import shutil
import subprocess

import pytest

from tests.helpers.doc_blocks import ROOT, blocks_run_by

HERE = "tests/unit/test_docs_commands.py::"
MAKE_PAGES = ("README.md", "docs/getting-started.md", "docs/guides/gpu-check.md", "docs/project/tests.md")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("page", MAKE_PAGES)
def test_make_lines_name_real_targets(page):
    lines = [line for b in blocks_run_by(page, HERE + "test_make_lines_name_real_targets")
             for line in b.text.splitlines() if line.strip()]
    assert lines and all(line.startswith("make ") for line in lines), lines
    for line in lines:
        argv = shlex.split(line, comments=True)
        proc = subprocess.run(["make", "-n", *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, (line, proc.stdout[-2000:], proc.stderr[-2000:])


def test_plan_command_prints_the_page_output(capsys):
    from hf_longctx.cli import main

    command, output = blocks_run_by("docs/guides/memory.md", HERE + "test_plan_command_prints_the_page_output")
    (line,) = [x for x in command.text.splitlines() if x.strip()]
    argv = shlex.split(line)
    assert argv[0] == "hf-longctx", line
    assert main([a if not a.startswith("tests/") else str(ROOT / a) for a in argv[1:]]) == 0
    printed = capsys.readouterr().out
    missing = [x for x in output.text.splitlines() if x.strip() and x.strip() not in printed]
    assert not missing, (missing, printed[-3000:])


def test_grpo_plan_command_prints_the_page_output(capsys):
    """docs/guides/grpo.md: the `--task grpo --rollout-tokens` plan prints the suggestion the page shows."""
    from hf_longctx.cli import main

    command, output = blocks_run_by("docs/guides/grpo.md", HERE + "test_grpo_plan_command_prints_the_page_output")
    (line,) = [x for x in command.text.splitlines() if x.strip()]
    argv = shlex.split(line)
    assert argv[0] == "hf-longctx" and "--rollout-tokens" in argv, line
    assert main([a if not a.startswith("tests/") else str(ROOT / a) for a in argv[1:]]) == 0
    printed = capsys.readouterr().out
    missing = [x for x in output.text.splitlines() if x.strip() and x.strip() not in printed]
    assert not missing, (missing, printed[-3000:])


def test_dpo_plan_command_states_its_suggestion(capsys):
    """docs/guides/dpo.md: the `--task dpo` plan's first row is the setting and peak the page states."""
    import re

    from hf_longctx.cli import main

    (block,) = blocks_run_by("docs/guides/dpo.md", HERE + "test_dpo_plan_command_states_its_suggestion")
    (line,) = [x for x in block.text.splitlines() if x.strip()]
    argv = shlex.split(line)
    assert argv[0] == "hf-longctx" and "--task" in argv, line
    assert main([a if not a.startswith("tests/") else str(ROOT / a) for a in argv[1:]]) == 0
    table = [r for r in capsys.readouterr().out.splitlines() if r.startswith("|")]
    cells = lambda r: [c.strip() for c in r.strip("|").split("|")]  # noqa: E731
    row = dict(zip(cells(table[0]), cells(table[2])))  # the header, then the best setting
    text = " ".join((ROOT / "docs/guides/dpo.md").read_text().split())
    said = re.search(r"this suggests Ulysses (\d+), `memory=\"(\w+)\"` with parameter offload, an estimated peak of "
                     r"([\d.]+) GiB per GPU", text)
    assert said, "the DPO guide's plan sentence is gone"
    assert said.groups() == (row["ulysses"], row["memory"], row["peak GiB"]) and row["param offload"] == "yes", (said.groups(), row)
