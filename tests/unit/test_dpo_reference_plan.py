"""The planner's precomputed DPO reference (`--task dpo-precomputed`, capacity/dpo_reference.py):
against `--task dpo` it holds no reference shards (exactly 4 bytes x params / world less in
params) and has no reference-forward phase nor per-token reference log-probs; `plan --task dpo`
prints which reference it picks, with both peaks, and then suggests the one it picks."""

from __future__ import annotations

import re

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


def _blocks(out: str) -> tuple[str, str, str]:
    """(the verdict line, the suggested code, the recipe flags) of a plan's output."""
    verdict = next(x for x in out.splitlines() if x.startswith("DPO reference:"))
    code = out.split("\nsuggested (", 1)[1].split("):\n", 1)[1].split("\n\n", 1)[0]
    flags = re.search(r"as recipe flags \(recipes/dpo.py\):\n(.*)\n", out).group(1)
    return verdict, code, flags


def test_the_suggestion_is_the_reference_the_plan_picks(capsys):
    """--task dpo ranks the held reference and picks the precomputed one: the suggestion printed
    after the verdict is the precomputed reference's best (its trainer line and recipe flag), the
    setting the verdict names, and what --task dpo-precomputed suggests."""
    argv = ["plan", "--model", CONFIG, "--gpus", "8", "--gpu-memory", "80GiB", "--host-memory", "2048GiB",
            "--seq-len", "4194304", "--top", "1"]
    assert main([*argv, "--task", "dpo"]) == 0
    out = capsys.readouterr().out
    verdict, code, flags = _blocks(out)
    assert "Picks precomputed" in verdict and out.index(verdict) < out.index("\nsuggested ("), out[-3000:]
    assert "precompute_ref_log_probs=True" in code and flags.endswith("--precompute-ref-log-probs"), (code, flags)
    u, r, f = re.search(r"its best: U(\d+)xR(\d+), fpdt (\d+)", verdict).groups()
    assert f"ulysses_degree={u}, ring_degree={r}, fpdt_chunks={f})" in code, (verdict, code)
    assert main([*argv, "--task", "dpo-precomputed"]) == 0
    _, precomputed_code, precomputed_flags = _blocks("DPO reference:\n" + capsys.readouterr().out)
    assert (code, flags) == (precomputed_code, precomputed_flags)


def test_only_the_precomputed_reference_fits(capsys):
    """70B at 768K on 8 GPUs: the held reference fits nowhere, the precomputed one does: the plan
    says so and suggests it (exit 0), not "no setting fits" alone (exit 1)."""
    assert main(["plan", "--model", "tests/data/llama-3-70b-config.json", "--gpus", "8", "--gpu-memory", "80GiB",
                 "--host-memory", "2048GiB", "--seq-len", "786432", "--task", "dpo", "--top", "1"]) == 0
    captured = capsys.readouterr()
    assert "no setting fits with the reference held: the closest is" in captured.err, captured.err
    verdict, code, flags = _blocks(captured.out)
    assert "Picks precomputed: only it fits" in verdict, verdict
    assert "precompute_ref_log_probs=True" in code and "--precompute-ref-log-probs" in flags, (code, flags)
