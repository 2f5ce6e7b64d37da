"""Running a recipe the way the README does: `accelerate launch` on CPU ranks, then its logs.

`launch(recipe, *args, processes=2)` runs recipes/<recipe> under `accelerate launch`
(gloo, no mixed precision, no dynamo) with the repository on PYTHONPATH and returns the
finished process; `rank_logs(out_dir)` reads the per-rank step logs the recipes write
(OUTPUT_DIR/steps.rank<R>.jsonl); `assert_ranks_agree` checks that every rank logged the
same steps with finite values, equal on every rank except the given timing keys (the
logged values are global); `recipe_modules(*names)` imports recipes/<name>.py as modules (their
parsers and helpers, in this process). ROOT is the repository root.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def recipe_modules(*names: str) -> tuple:
    """recipes/<name>.py for each name, imported with recipes/ first on sys.path (as the recipes
    import their `common`)."""
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    try:
        return tuple(importlib.import_module(name) for name in names)
    finally:
        sys.path.pop(0)


def launch(recipe: str, *args: str, processes: int = 2) -> subprocess.CompletedProcess:
    """`accelerate launch` of a recipe on `processes` CPU ranks (what the README's CPU line does)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines",
           "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
           os.path.join(ROOT, "recipes", recipe), *args]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def rank_logs(out_dir, ranks: int = 2) -> list[list[dict]]:
    """[rank][step]: the logs every rank wrote to OUTPUT_DIR/steps.rank<R>.jsonl."""
    return [[json.loads(line) for line in open(os.path.join(out_dir, f"steps.rank{r}.jsonl"))] for r in range(ranks)]


def assert_ranks_agree(logs: list[list[dict]], steps: list[int], timing: set[str]) -> None:
    """Every rank logged `steps`, every value finite, and equal on every rank except the `timing` keys
    (the logged values are global: a rank that trained on its own data or its own count differs)."""
    assert all([r["step"] for r in rank] == steps for rank in logs), logs
    for step0, *others in zip(*logs):
        for k, v in step0.items():
            assert math.isfinite(v), (k, step0)
            for r, other in enumerate(others, 1):
                if k not in timing:
                    assert other[k] == v, f"step {step0['step']}: {k} is {v} on rank 0, {other[k]} on rank {r}"
