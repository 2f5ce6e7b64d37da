"""recipes/vlm_sft.py runs as the README says: `accelerate launch` on 4 CPU ranks (gloo,
Ulysses 2 x ring 2, FSDP2), its tiny Qwen2.5-VL-style model, processor and synthetic images
and videos built locally. Both steps finish; every logged value is finite and equal on all
ranks except the timings; rank 0 prints each step's loss and the trained tokens per second; neither
FSDP2's "returned a view tensor" warning nor transformers' deprecation of `gradient_checkpointing`
is printed."""

from __future__ import annotations

import math

from tests.helpers.recipe_launch import launch, rank_logs

TIMING = {"tokens_per_s", "train_runtime", "train_tokens_per_second", "peak_mem_gib"}


def test_vlm_recipe_runs_on_four_ranks(tmp_path):
    proc = launch("vlm_sft.py", "--steps", "2", "--output-dir", str(tmp_path), processes=4)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "dp 1 x ring 2 x ulysses 2" in proc.stdout, out[-2000:]
    logs = rank_logs(tmp_path, ranks=4)
    for rank in range(4):
        assert [r["step"] for r in logs[rank]] == [1, 2], logs[rank]
        for step, first in zip(logs[rank], logs[0]):
            for k, v in step.items():
                assert math.isfinite(v), (k, step)
                if k not in TIMING:
                    assert v == first[k], f"rank {rank} step {step['step']}: {k} {v} vs rank 0 {first[k]}"
    assert logs[0][1]["loss"] < logs[0][0]["loss"] and logs[0][0]["grad_norm"] > 0
    for line in ("step 1: loss=", "step 2: loss=", "tokens/s"):
        assert line in proc.stdout, (line, out[-2000:])
    for warning in ("returned a view tensor", "`gradient_checkpointing` is deprecated"):  # FSDP2's, transformers'
        assert warning not in out, (warning, out[-3000:])
