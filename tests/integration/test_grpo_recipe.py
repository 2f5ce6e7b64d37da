"""recipes/grpo.py (on `LongGRPOTrainer`) runs as documented under `accelerate launch` on 2 CPU
ranks (gloo, Ulysses 2, FSDP2): the tiny Llama the recipe builds and saves, its locally made
prompts, its format reward, TRL's real sampling, beta > 0 with TRL's reference. Both steps
finish; every logged value is finite and the SAME on both ranks (global values); step 1 has
kl 0 (policy == reference) and a reward spread (non-zero advantages), step 2 kl > 0 (the
update reached the policy, not the reference); rank 0 prints TRL's metric names. Also with --max-tokens 40 (the step's 4 rows of up to ~28
tokens split into packed micro-batches with gradient accumulation): the same checks."""

from __future__ import annotations

import pytest

from tests.integration.test_dpo_recipe import assert_ranks_agree, launch, rank_logs

TIMING = {"step_time"}  # wall-clock: differs between ranks


@pytest.mark.parametrize("extra", [[], ["--max-tokens", "40"]], ids=["one_microbatch", "max_tokens"])
def test_grpo_recipe_runs(tmp_path, extra):
    proc = launch("grpo.py", "--ulysses", "2", "--steps", "2", "--beta", "0.04", "--loss-type", "grpo",
                  "--per-device-train-batch-size", "2", "--num-generations", "2", "--max-completion-length", "16",
                  "--output-dir", str(tmp_path), *extra)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    logs = rank_logs(tmp_path)
    assert_ranks_agree(logs, [1, 2], TIMING)
    first, second = logs[0]
    assert first["kl"] == 0.0 and first["reward_std"] > 0 and first["grad_norm"] > 0, first
    assert second["kl"] > 0, second
    for name in ("step 1: loss=", "step 2: loss=", "grad_norm=", "reward=", "kl=", "entropy=", "clip_ratio/region_mean=",
                 "rewards/format_reward/mean="):
        assert name in proc.stdout, (name, out[-2000:])
