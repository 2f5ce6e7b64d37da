"""The multi-node guide's host-memory figures are what its planner command prints today.

docs/guides/multi-node.md runs `hf-longctx plan` for two nodes of 8 GPUs (its block, the
command this test parses and reruns: the planner is pure arithmetic, seconds) and states the
first row's Ulysses degree, preset, host memory per GPU and per node against the usable host
memory, and which memory binds first; each is compared with the command's table and fit line.
"""

from __future__ import annotations

import os
import re

from hf_longctx.cli import main
from tests.helpers.doc_blocks import ROOT, blocks_run_by

PAGE = "docs/guides/multi-node.md"


def _first_row(out: str) -> dict[str, str]:
    lines = [line for line in out.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return dict(zip(header, [c.strip() for c in lines[2].strip("|").split("|")]))


def test_the_multi_node_example_states_what_the_command_prints(capsys):
    import shlex

    (block,) = blocks_run_by(PAGE, "tests/unit/test_docs_multinode_plan.py::test_the_multi_node_example_states_what_the_command_prints")
    argv = shlex.split(block.text.replace("\\\n", " "))
    assert argv[0] == "hf-longctx", argv
    argv = [os.path.join(ROOT, a) if a.startswith("tests/") else a for a in argv[1:]]
    assert main(argv) == 0
    out = capsys.readouterr().out
    row = _first_row(out)
    fit = re.search(r"uses (\d+)% of the usable GPU memory and (\d+)% of the usable host memory: (\w+) memory", out)
    said = re.search(r"its first row, Ulysses (\d+) \(dp (\d+)\) with `memory=\"(\w+)\"`( and `keep_attention=True`)?, pins "
                     r"([\d.]+) GiB per GPU: ([\d,]+) GiB per node, (\d+) % of the usable ([\d,]+) GiB against (\d+) % of "
                     r"the usable GPU memory, so (\w+) memory", " ".join((ROOT / PAGE).read_text().split()))
    assert fit and said, "the multi-node guide's host-memory sentence is gone"
    gpus_per_node = int(argv[argv.index("--gpus-per-node") + 1])
    usable = 0.9 * 2048  # --host-memory 2TiB less the default 10 % headroom
    assert argv[argv.index("--host-memory") + 1] == "2TiB", argv
    host = float(row["host GiB/GPU"])
    want = (row["ulysses"], row["dp"], row["memory"], row["ckpt"] == "full, keep attn out", row["host GiB/GPU"],
            f"{host * gpus_per_node:,.0f}", fit.group(2), f"{usable:,.0f}", fit.group(1), fit.group(3))
    got = said.groups()
    assert got[:3] + (got[3] is not None,) + got[4:] == want, (got, want)
