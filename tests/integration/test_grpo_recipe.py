"""recipes/grpo.py (on `LongGRPOTrainer`) runs as documented under `accelerate launch` on 2 CPU
ranks (gloo, Ulysses 2, FSDP2): the tiny Llama the recipe builds and saves, its locally made
prompts, its format reward, TRL's real sampling, beta > 0 with TRL's reference. Both steps
finish; every logged value is finite and the SAME on both ranks (global values); step 1 has
kl 0 (policy == reference) and a reward spread (non-zero advantages), step 2 kl > 0 (the
update reached the policy, not the reference); rank 0 prints TRL's metric names and the step's
tokens/s. Also with --max-tokens 40 (the step's 4 rows of up to ~28
tokens split into packed micro-batches with gradient accumulation) under `--memory high
--inputs-on-device 1` (the patch line reads the options back from the trained model): the same
checks. Generation is sequence-parallel (rank 0 prints the weights' placement once) unless
--generation per-rank (TRL's generate per rank): both run the same checks. With
--save-every / --resume, a resumed step 2 logs exactly what the uninterrupted run logged."""

from __future__ import annotations

import pytest

from tests.helpers.recipe_launch import assert_ranks_agree, launch, rank_logs

TIMING = {"step_time", "tokens_per_s"}  # wall-clock: differs between ranks


@pytest.mark.parametrize("extra", [[], ["--max-tokens", "40", "--memory", "high", "--inputs-on-device", "1"],
                                   ["--generation", "per-rank"]],
                         ids=["one_microbatch", "max_tokens_memory_high", "per_rank_generation"])
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
    assert first["tokens_per_s"] > 0 and second["tokens_per_s"] > 0, (first, second)
    memory = ("memory='high', checkpoint='attention', kv_offload=False, mlp_chunks='auto', loss_chunks='auto', "
              "inputs_on_device=1") if "--memory" in extra else "memory=None, checkpoint=False"
    assert f"patched: {memory}" in proc.stdout, out[-2000:]
    sp = "--generation" not in extra  # sequence-parallel generation by default: rank 0 names the weights' placement once
    assert (proc.stdout.count("sp_generate: weights") == 1) == sp, out[-2000:]
    for name in ("step 1: loss=", "step 2: loss=", "grad_norm=", "reward=", "kl=", "entropy=", "clip_ratio/region_mean=",
                 "rewards/format_reward/mean=", "tokens_per_s="):
        assert name in proc.stdout, (name, out[-2000:])


def test_grpo_recipe_resume_matches_uninterrupted(tmp_path):
    """`--save-every 1` writes checkpoint-1 and -2; with checkpoint-2 removed, `--resume` continues
    from checkpoint-1 in the same output dir (same tiny model path, so TRL rebuilds the same
    reference) and logs step 2 exactly as the uninterrupted run did: TRL's REAL sampling,
    so the completions (and every metric) agree only if each rank's RNG, the sampler position,
    the policy and AdamW shards came back."""
    import shutil

    common = ("--ulysses", "2", "--steps", "2", "--beta", "0.04", "--per-device-train-batch-size", "2",
              "--num-generations", "2", "--max-completion-length", "12", "--save-every", "1",
              "--output-dir", str(tmp_path))
    first = launch("grpo.py", *common)
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    full = rank_logs(tmp_path)
    assert (tmp_path / "checkpoint-1").is_dir() and (tmp_path / "checkpoint-2").is_dir()
    shutil.rmtree(tmp_path / "checkpoint-2")
    second = launch("grpo.py", *common, "--resume")
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    resumed = rank_logs(tmp_path)
    assert_ranks_agree(resumed, [2], TIMING)
    for rank in range(2):
        want = {k: v for k, v in full[rank][1].items() if k not in TIMING}
        got = {k: v for k, v in resumed[rank][0].items() if k not in TIMING}
        assert got == want, f"rank {rank}: resumed step 2 {got} != uninterrupted {want}"
