"""The planner figures the documentation states are what its commands print today.

The planner guide's one-node Llama-3.1-8B example (`hf-longctx plan --model
tests/data/llama-3.1-8b-config.json --gpus 8 --gpu-memory 80GiB --host-memory 512GiB
--seq-len 1048576`) states the suggestion's estimated peak, host memory per GPU, tokens/s,
MFU by the three counts the plan prints and what binds (docs/guides/memory.md; its code block, the command's suggestion verbatim, is
tests/unit/test_docs_commands.py's); the measured memory page states the host memory per GPU
of the 1 TiB-host plan (docs/measured/memory.md); the GRPO and DPO guides state what the 4M-token
`--task grpo` plan answers when each GPU generates the assumed 4M rollout tokens (the GPU
peak, the most rollout tokens that fit). Each is rerun here (the planner is pure arithmetic:
seconds) and compared with the pages' text.
"""

from __future__ import annotations

import os
import re

import pytest

from hf_longctx.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "tests", "data", "llama-3.1-8b-config.json")
PLAN = ["plan", "--model", CONFIG, "--gpus", "8", "--gpu-memory", "80GiB", "--seq-len", "1048576", "--top", "1"]


def _page(name: str) -> str:
    return " ".join(open(os.path.join(ROOT, "docs", name)).read().split())  # whitespace (line breaks) as single spaces


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
    row, text = _first_row(plans["512GiB"]), _page("guides/memory.md")
    said = re.search(r"estimated peak ([\d.]+) GiB per GPU, ([\d.]+) GiB host per GPU, one micro-batch per step, "
                     r"(\d+) tokens/s per GPU, modelled MFU ([\d.]+) % on H100s \(this project's strict count: "
                     r"[^;]*; ([\d.]+) % by torchtitan's count, ([\d.]+) % by Megatron-DeepSpeed's, as the plan "
                     r"prints\), bound by ([\w ]+?):", text)
    assert said, "the planner guide's one-node example sentence is gone"
    printed = re.search(r"modelled MFU ([\d.]+) % \(strict\) = ([\d.]+) % by torchtitan's count = ([\d.]+) % by "
                        r"Megatron-DeepSpeed's", plans["512GiB"])
    assert printed and printed.group(1) == row["MFU %"], plans["512GiB"][-2000:]
    want = (row["peak GiB"], f"{float(row['host GiB/GPU']):.0f}", row["tok/s/GPU"], row["MFU %"], *printed.groups()[1:],
            row["binds"])
    assert said.groups() == want, (said.groups(), row)


def test_the_presets_section_states_the_1tib_host_figure(plans):
    row = _first_row(plans["1TiB"])
    assert (row["memory"], row["ckpt"]) == ("max", "full, keep attn out"), row
    assert f"(1M tokens with 1 TiB host: {row['host GiB/GPU']} GiB of host per GPU)" in _page("measured/memory.md"), row


def test_the_grpo_and_dpo_guides_state_what_the_rollouts_plan_answers(capsys):
    assert main(["plan", "--model", CONFIG, "--gpus", "8", "--gpu-memory", "80GiB", "--host-memory", "2048GiB",
                 "--seq-len", "4194304", "--task", "grpo", "--top", "1"]) == 1
    err = capsys.readouterr().err
    peak = re.search(r"generating 4194304 tokens per GPU needs ([\d.]+) GiB per GPU", err).group(1)
    fit = re.search(r"At most ([\d,]+) rollout tokens per GPU fit", err).group(1)
    said = ("each GPU generating the assumed 4M tokens needs " + peak + " GiB per GPU",
            f"(at most {fit} rollout tokens per GPU)")
    for text in said:
        assert text in _page("guides/grpo.md"), (text, err)
    assert f"(the closest setting needs {round(float(peak)):,} GiB per GPU" in _page("guides/dpo.md"), err

