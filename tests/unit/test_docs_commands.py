"""The shell commands of the pages that run cheaply, run from the page: every `make` line of a
block marked for `test_make_lines_name_real_targets` is dry-run (`make -n`, so the target and
its variables exist and parse), the `hf-longctx plan` commands of the planner and GRPO guides
print the suggestion the page shows in the block after each, and the DPO guide's `--task dpo`
commands print the settings and figures its sentences state (`tests/helpers/doc_blocks.py`)."""

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
    """docs/guides/dpo.md: the `--task dpo` plan's first row (the held reference) and its suggestion
    (the precomputed reference it picks) are the settings and peaks the page states."""
    import re

    from hf_longctx.cli import main

    (block,) = blocks_run_by("docs/guides/dpo.md", HERE + "test_dpo_plan_command_states_its_suggestion")
    (line,) = [x for x in block.text.splitlines() if x.strip()]
    argv = shlex.split(line)
    assert argv[0] == "hf-longctx" and "--task" in argv, line
    assert main([a if not a.startswith("tests/") else str(ROOT / a) for a in argv[1:]]) == 0
    out = capsys.readouterr().out
    table = [r for r in out.splitlines() if r.startswith("|")]
    cells = lambda r: [c.strip() for c in r.strip("|").split("|")]  # noqa: E731
    row = dict(zip(cells(table[0]), cells(table[2])))  # the header, then the best setting
    text = " ".join((ROOT / "docs/guides/dpo.md").read_text().split())
    held = re.search(r"the held reference's best, is Ulysses (\d+), `memory=\"(\w+)\"` with parameter offload, an "
                     r"estimated peak of ([\d.]+) GiB per GPU", text)
    assert held, "the DPO guide's held-reference sentence is gone"
    assert held.groups() == (row["ulysses"], row["memory"], row["peak GiB"]), (held.groups(), row)
    assert row["param offload"] == "yes", row
    picked = re.search(r"picks the precomputed reference and suggests its best: Ulysses (\d+), FPDT (\d+), "
                       r"`memory=\"(\w+)\"`, an estimated peak of ([\d.]+) GiB per GPU", text)
    assert picked, "the DPO guide's suggestion sentence is gone"
    u, f, memory, peak = picked.groups()
    verdict = next(x for x in out.splitlines() if x.startswith("DPO reference:"))
    assert f"its best: U{u}xR1, fpdt {f}, dp 1: peak {peak} GiB" in verdict and "Picks precomputed" in verdict, verdict
    code = out.split("\nsuggested (", 1)[1]
    assert f"init_sequence_parallel(ulysses_degree={u}, ring_degree=1, fpdt_chunks={f})" in code, code
    assert f"memory={memory!r}" in code and "precompute_ref_log_probs=True)" in code, code
    flags = re.search(r"as recipe flags \(recipes/dpo.py\):\n(.*)\n", out).group(1)
    assert flags.endswith("--precompute-ref-log-probs") and "--param-offload" not in flags, flags
    # the precomputed-reference section's figures of the same command
    host = re.search(r"host ([\d.]+) GiB/GPU \(-([\d.]+):", verdict).groups()
    held_tps = re.search(r"~([\d,]+) tokens/s with its forward charged", verdict).group(1)
    best_tps = re.search(r"its best: [^;]*?, ([\d,]+) tokens/s", verdict).group(1)
    said = (f"the host holds {host[1]} GiB per GPU less ({host[0]} instead of "
            f"{float(host[0]) + float(host[1]):.1f} GiB)",
            f"is Ulysses {u}, FPDT {f}, `memory=\"{memory}\"` without parameter offload, {peak} GiB, {best_tps} "
            f"tokens/s against the held reference's ~{held_tps} with its forward charged")
    for sentence in said:
        assert sentence in text, (sentence, verdict)


def test_dpo_reference_command_states_its_figures(capsys):
    """docs/guides/dpo.md, precomputed reference: the 1M-token `--task dpo` plan's verdict states the
    held reference's setting, peak and tokens/s, the precomputed reference's, and the speed-up the
    page states; its suggestion is the precomputed reference."""
    import re

    from hf_longctx.cli import main

    (block,) = blocks_run_by("docs/guides/dpo.md", HERE + "test_dpo_reference_command_states_its_figures")
    (line,) = [x for x in block.text.splitlines() if x.strip()]
    argv = shlex.split(line)
    assert main([a if not a.startswith("tests/") else str(ROOT / a) for a in argv[1:]]) == 0
    out = capsys.readouterr().out
    table = [r for r in out.splitlines() if r.startswith("|")]
    cells = lambda r: [c.strip() for c in r.strip("|").split("|")]  # noqa: E731
    row = dict(zip(cells(table[0]), cells(table[2])))
    verdict = next(x for x in out.splitlines() if x.startswith("DPO reference:"))
    u, dp, peak, tps = re.search(r"held: U(\d+)xR1, fpdt 1, dp (\d+): peak ([\d.]+) GiB, ~([\d,]+) tokens/s",
                                 verdict).groups()
    same, less = re.search(r"at that setting GPU peak ([\d.]+) GiB \(-([\d.]+)\)", verdict).groups()
    best_tps = re.search(r"its best: U\d+xR1, fpdt 1, dp \d+: peak [\d.]+ GiB, ([\d,]+) tokens/s", verdict).group(1)
    ratio = re.search(r"([\d.]+)x the steps per second", verdict).group(1)
    text = " ".join((ROOT / "docs/guides/dpo.md").read_text().split())
    for sentence in (f"held reference at Ulysses {u} (dp {dp}), `memory=\"{row['memory']}\"`: peak {peak} GiB per GPU "
                     f"and ~{tps} tokens/s", f"precomputed at the same setting: {same} GiB (−{less} GiB: the "
                     f"reference's fp32 shards) and {best_tps} tokens/s", f"it runs {ratio}× the steps per second"):
        assert sentence in text, (sentence, verdict)
    trainer = next(x for x in out.split("\nsuggested (", 1)[1].splitlines() if x.startswith("trainer = "))
    assert "DPOConfig(..., max_length=None, precompute_ref_log_probs=True)" in trainer, trainer
