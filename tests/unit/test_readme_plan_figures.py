"""The planner figures the README prints are what its commands print today.

The README's one-node Llama-3.1-8B example (`hf-longctx plan --model
tests/data/llama-3.1-8b-config.json --gpus 8 --gpu-memory 80GiB --host-memory 512GiB
--seq-len 1048576`) states the suggestion's estimated peak, host memory per GPU and tokens/s,
and its code block is the command's suggestion verbatim; the memory-presets section states the
host memory per GPU of the 1 TiB-host plan. Each is rerun here (the planner is pure
arithmetic: seconds) and compared with the README's text.
"""

from __future__ import annotations

import os
import re

import pytest

from hf_longctx.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "tests", "data", "llama-3.1-8b-config.json")
PLAN = ["plan", "--model", CONFIG, "--gpus", "8", "--gpu-memory", "80GiB", "--seq-len", "1048576", "--top", "1"]


def _readme() -> str:
    return " ".join(open(os.path.join(ROOT, "README.md")).read().split())  # whitespace (line breaks) as single spaces


def _first_row(out: str) -> dict[str, str]:
    lines = [line for line in out.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return dict(zip(header, [c.strip() for c in lines[2].strip("|").split("|")]))


@pytest.fixture(scope="module")
def plans():
    import contextlib
    import io

    out = {}
    for host in ("512GiB", "1TiB"):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main([*PLAN, "--host-memory", host]) == 0
        out[host] = buf.getvalue()
    return out


def test_the_one_node_example_states_what_the_command_prints(plans):
    row, text = _first_row(plans["512GiB"]), _readme()
    said = re.search(r"estimated peak ([\d.]+) GiB per GPU, ([\d.]+) GiB host per GPU, one micro-batch per step, "
                     r"(\d+) tokens/s per GPU", text)
    assert said, "the README's one-node example sentence is gone"
    assert said.groups() == (row["peak GiB"], f"{float(row['host GiB/GPU']):.0f}", row["tok/s/GPU"]), (said.groups(), row)
    code = plans["512GiB"].split("suggested", 1)[1].split("\n", 1)[1]  # the suggestion's code and flag lines
    for line in (ln for ln in code.splitlines() if ln.strip()):
        assert " ".join(line.split()) in text, f"the README's example block lacks: {line}"


def test_the_presets_section_states_the_1tib_host_figure(plans):
    row = _first_row(plans["1TiB"])
    assert row["memory"] == "high"
    assert f"(1M tokens with 1 TiB host: {row['host GiB/GPU']} GiB of host per GPU)" in _readme(), row
