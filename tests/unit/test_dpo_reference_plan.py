"""The planner's precomputed DPO reference (`--task dpo-precomputed`, capacity/dpo_reference.py):
against `--task dpo` it holds no reference shards (exactly 4 bytes x params / world less in
params) and has no reference-forward phase nor per-token reference log-probs; `plan --task dpo`
prints which reference it picks, with both peaks."""

from __future__ import annotations

from hf_longctx.capacity.budget import step_budget
from hf_longctx.capacity.estimate import ModelDims, Setting, estimate_memory
from hf_longctx.cli import main
from hf_longctx.cli.inputs import load_config

CONFIG = "tests/data/llama-3.1-8b-config.json"


def test_precomputed_reference_holds_no_shards_and_runs_no_forward():
    dims = ModelDims.from_config(load_config(CONFIG))
    s = Setting(ulysses=8, ring=1, fpdt_chunks=1, checkpoint=True)
    held, pre = (estimate_memory(dims, s, world=8, tokens=2**20, task=t) for t in ("dpo", "dpo-precomputed"))
    assert held.params - pre.params == 4 * dims.params / 8
    phases = {t: [p.name for p in step_budget(dims, s, tokens=2**20, task=t).phases] for t in ("dpo", "dpo-precomputed")}
    ref = lambda names: [n for n in names if n.startswith("reference forward")]  # noqa: E731
    assert ref(phases["dpo"]) and not ref(phases["dpo-precomputed"])
    assert held.activations - pre.activations == 4 * 2**20 / 8  # the reference's fp32 log-prob per local token


def test_plan_task_dpo_says_which_reference_it_picks(capsys):
    code = main(["plan", "--model", CONFIG, "--gpus", "8", "--gpu-memory", "80GiB", "--host-memory", "2048GiB",
                 "--seq-len", "1048576", "--task", "dpo", "--top", "1", "--param-offload", "no"])
    out = capsys.readouterr().out
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("DPO reference: held: U4xR1"))
    assert "at that setting GPU peak" in line and "Picks precomputed" in line and "1.25x" in line, line
