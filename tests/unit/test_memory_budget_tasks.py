"""The per-token memory budget of DPO and GRPO steps: the planner's terms (`capacity/task_budget.py`)
against the census of a real step, and the step against SFT's.

The census (`benchmarks/memory_budget.py --tasks`, `benchmarks/post_training_steps.py`) counts
the frozen reference's forward (patched as the trainers patch it), the policy's forward through
the chunked log-prob head, the objective and the backward, on one process, bf16, shape T1. The
planner's device peak must be within 5 % of it (as tests/unit/test_memory_budget.py for SFT),
with nothing subtracted: every backend returns its attention output token-major (the tiled CPU
driver assembles a row of several documents straight into that layout), so no layout copy
depends on which CPU kernel runs. And the targets: a DPO or GRPO step's device bytes per token
within 1.15x of an SFT step's at the same preset and length.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.memory_budget import estimate, measure_lengths
from hf_longctx.distributed.mesh import init_sequence_parallel

TOKENS = 2048
LAYOUT_COPY = "usp.py:_from_ring clone"  # what a head-major attention output would cost: absent


def _census(mode: str, task: str) -> dict:
    torch.manual_seed(0)
    (got,) = measure_lengths(init_sequence_parallel(1, 1), "T1", mode, [TOKENS], warm_up=False, task=task)
    return got


@pytest.mark.parametrize("mode", ["balanced", "max", "max u=4 offload"])
def test_planner_terms_agree_with_the_census_for_dpo_and_grpo(mode):
    sft = _census(mode, "sft")["device"]
    for task in ("dpo", "grpo"):
        got = _census(mode, task)
        assert not [name for name, _ in got["by_name"] if name.endswith(LAYOUT_COPY)], (task, "head-major attention output")
        device, host = estimate("T1", mode, TOKENS, 1, 1, task)
        assert abs(device / got["device"] - 1) <= 0.05, (task, device / got["s_local"], got["device"] / got["s_local"])
        if got["host"] or host:
            assert abs(host / got["host"] - 1) <= 0.05, (task, host, got["host"])
        assert got["device"] <= 1.15 * sft, (task, got["device"] / sft)
