"""recipes/rloo.py (on `LongRLOOTrainer`) runs as documented under `accelerate launch` on 2 CPU
ranks (gloo, Ulysses 2, FSDP2): the tiny Llama the recipe builds and saves, its made-up prompts,
the format reward, TRL's real sampling, the KL penalty in the reward (TRL's default beta 0.05,
the reference loaded again from the policy's path) and --max-tokens 40 (scoring and training in
packed micro-batches), under `--memory max` with FPDT chunks 2 (the patch line reads the options
back from the trained model). Both steps finish; every logged value is finite and the SAME on both
ranks (global values); step 1 has kl exactly 0 (policy == reference: both forwards on the same
shards) and a reward spread, step 2 kl != 0 (the update reached the policy, not the reference;
RLOO's per-token estimate is the plain log-ratio, so its sign is free); rank 0 prints TRL's
metric names."""

from __future__ import annotations

from tests.helpers.recipe_launch import assert_ranks_agree, launch, rank_logs

TIMING = {"step_time", "tokens_per_s"}  # wall-clock: differs between ranks


def test_rloo_recipe_runs(tmp_path):
    proc = launch("rloo.py", "--ulysses", "2", "--steps", "2", "--per-device-train-batch-size", "2",
                  "--num-generations", "2", "--max-completion-length", "16", "--max-tokens", "40",
                  "--memory", "max", "--fpdt-chunks", "2", "--output-dir", str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    logs = rank_logs(tmp_path)
    assert_ranks_agree(logs, [1, 2], TIMING)
    first, second = logs[0]
    assert first["kl"] == 0.0 and first["reward_std"] > 0 and first["grad_norm"] > 0, first
    assert second["kl"] != 0.0, second
    assert "patched: memory='max', checkpoint=True, kv_offload=True" in proc.stdout, out[-2000:]
    for name in ("step 1: loss=", "step 2: loss=", "grad_norm=", "reward=", "kl=", "entropy=", "clip_ratio/region_mean=",
                 "rewards/format_reward/mean=", "tokens_per_s="):
        assert name in proc.stdout, (name, out[-2000:])
