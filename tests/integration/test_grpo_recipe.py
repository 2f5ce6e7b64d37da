"""recipes/grpo.py runs as documented on 2 CPU ranks (torchrun, gloo, Ulysses 2, FSDP2): a tiny
random Llama, made-up prompts, the recipe's reward, real sampling, beta > 0 with a reference
copy; it must finish both steps and print TRL's metric names."""

from __future__ import annotations

import os
import sys

import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_grpo_recipe_runs(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "recipes", "grpo.py"), "--ulysses", "2", "--steps", "2", "--beta", "0.04",
           "--loss-type", "grpo", "--output-dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for name in ("step 2:", "grad_norm=", "reward=", "kl=", "entropy=", "clip_ratio/region_mean="):
        assert name in out, (name, out[-2000:])
