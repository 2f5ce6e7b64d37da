"""The "after" scripts of docs/guides/migrating.md, run as written on 4 gloo ranks.

Each block is taken from the page (`tests/helpers/doc_blocks.py`) and executed in every pool
worker with the names the page says it needs: `model_id` (a tiny Llama saved with
`save_pretrained`, 4 query / 2 KV heads, loaded by the block with `from_pretrained`),
`output_dir`, `dataset` (the ALST script: documents with `input_ids`; ACCELERATE_USE_CPU=true, as
`accelerate launch` exports it from accelerate_configs/cpu_4proc.yaml) and `loader` (the
Accelerate CP loop: packed rows, the same on every rank). The ALST script's `ParallelismConfig(sp_size=4)`
must become Ulysses 4 and log the same global loss on every rank; the Accelerate CP loop's
`cp_size=4` a ring of 4 whose printed losses equal the unpatched model's in one process (fp32:
1e-5 relative, tests/distributed/test_trainer.py's argument).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.helpers.doc_blocks import blocks_run_by
from tests.helpers.families import load, packed_batch, save_family

PAGE = "docs/guides/migrating.md"
HERE = "tests/distributed/test_migration_scripts.py::"
TOL = 1e-5


def _exec(test: str, scope: dict) -> dict:
    (block,) = blocks_run_by(PAGE, HERE + test)
    exec(compile(block.text, f"{PAGE}:{block.line}", "exec"), scope)
    return scope


def _alst(model_id: str, output_dir: str) -> dict:
    from tests.helpers.trainer_cases import make_dataset, trainer_env

    trainer_env()  # the launcher's variables, from the pool's process group
    os.environ["ACCELERATE_USE_CPU"] = "true"  # what `accelerate launch` exports from cpu_4proc.yaml's use_cpu
    try:
        scope = _exec("test_alst_after_script", {"model_id": model_id, "output_dir": output_dir,
                                                 "dataset": make_dataset(masked=True)})
    finally:
        os.environ.pop("ACCELERATE_USE_CPU")  # the pool's workers live on
    trainer = scope["trainer"]
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "degrees": (trainer.mesh.ulysses, trainer.mesh.ring, trainer.mesh.dp), "max_tokens": trainer.max_tokens}


def _accelerate_cp(model_id: str) -> dict:
    printed = []
    scope = _exec("test_accelerate_cp_after_script", {
        "model_id": model_id, "loader": [packed_batch(seed=s) for s in (0, 1)],
        "print": lambda *a: printed.append(float(a[0])),
    })
    mesh = scope["mesh"]
    return {"losses": printed, "degrees": (mesh.ulysses, mesh.ring, mesh.dp)}


@pytest.fixture(scope="module")
def model_id(tmp_path_factory):
    return save_family("llama", tmp_path_factory.mktemp("migration"))


def test_alst_after_script(pools, model_id, tmp_path):
    out = pools.get(4).run(_alst, model_id, str(tmp_path), timeout=600)
    assert all(r["degrees"] == (4, 1, 1) and r["max_tokens"] == 64 for r in out), out
    losses = out[0]["losses"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
    assert all(r["losses"] == losses for r in out), [r["losses"] for r in out]


def test_accelerate_cp_after_script(pools, model_id):
    out = pools.get(4).run(_accelerate_cp, model_id, timeout=600)
    model = load(model_id)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    want = []
    for batch in [packed_batch(seed=s) for s in (0, 1)]:
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    for rank, res in enumerate(out):
        assert res["degrees"] == (1, 4, 1), res["degrees"]
        assert len(res["losses"]) == 2, res
        for a, b in zip(res["losses"], want):
            assert abs(a - b) <= TOL * abs(b), f"rank {rank}: loss {a} vs {b} in one process"
