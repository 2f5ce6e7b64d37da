"""recipes/dpo.py runs under `accelerate launch` on 2 CPU ranks (Ulysses 2) with a tiny local
Llama and a locally made pairs file, logging a finite DPO loss and the reward metrics."""

from __future__ import annotations

import json
import os
import sys

import torch

import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_dpo_recipe_runs(tmp_path):
    from tests.distributed.test_models import save_family

    model_dir = save_family("llama", tmp_path)
    g = torch.Generator().manual_seed(0)
    with open(tmp_path / "pairs.jsonl", "w") as f:
        for _ in range(4):
            ids = lambda n: torch.randint(1, 128, (n,), generator=g).tolist()  # noqa: E731
            f.write(json.dumps({"prompt": ids(5), "chosen": ids(9), "rejected": ids(6)}) + "\n")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           os.path.join(ROOT, "recipes", "dpo.py"), model_dir, str(tmp_path / "pairs.jsonl"),
           "--ulysses", "2", "--steps", "2", "--pairs-per-step", "2", "--mixed-precision", "fp32"]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    logs = [eval(line) for line in proc.stdout.splitlines() if line.startswith("{'step'")]  # noqa: S307
    assert [r["step"] for r in logs] == [1, 2], out[-2000:]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in logs)
    assert abs(logs[0]["loss"] - 0.693147) < 1e-4  # step 1: policy == reference, -log sigmoid(0)
    assert "rewards/margins" in logs[0]
