"""benchmarks/gpu_attention_backends.py on CPU: the dry run, the prediction file, the bounds.

The dry run runs every path the GPU run has with emulated kernels and tiny shapes (each
backend's exactness cases and timing, a tiny patched CPU step per step row with the same patch()
keywords, the prediction by the step-time model) and prints the plan; the prediction of other
code stops a GPU run before any GPU work; a hung worker is killed inside its bound; the step rows
run with the fastest EXACT backend."""

from __future__ import annotations

import json
import sys
import time

import pytest

from benchmarks import gpu_attention_backends as gab


def test_dry_run_runs_every_path_and_writes_the_prediction(tmp_path, capsys):
    assert gab.main(["--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "plan: backends ['cudnn', 'cudnn_frontend', 'flash_attn', 'torch_flash']" in out
    (path,) = tmp_path.glob("predictions_*_h100.json")  # the project's prediction API wrote it, before the rows
    prediction = json.loads(path.read_text())
    assert prediction["kind"] == "predictions" and prediction["card"] == "h100" and prediction["code"]
    assert f"gpu_attention_backends.py, sources {gab.code_digest()}" in prediction["written"]
    assert [(r["preset"], r["tokens"]) for r in prediction["rows"]] == list(gab.STEPS)
    assert all(r["predicted_s"] > 0 for r in prediction["rows"])
    result = json.loads((tmp_path / "gpu_attention_backends_dryrun.json").read_text())
    assert result["predictions"] == path.name
    exact = [r for r in result["kernels"] if r["kind"] == "exact"]
    assert {r["backend"] for r in exact} == {"cudnn", "cudnn_frontend", "flash_attn", "torch_flash"}
    assert all(r.get("exact") for r in exact if "skipped" not in r)
    assert [r["backend"] for r in exact if "skipped" in r] == ["cudnn"]  # cuDNN through torch has no window
    assert {(s["preset"], s["loss_rows"]) for s in result["steps"]} == (
        {(p, None) for p, _ in gab.STEPS} | {("chunked", r) for _, r in gab.LOSS_ROWS})
    assert all(s["fits"] for s in result["steps"])
    assert gab.main(["--dry-run", "--out", str(tmp_path)]) == 0  # the same sources: the same predictions, kept
    assert list(tmp_path.glob("predictions_*_h100.json")) == [path]


def test_other_sources_predictions_stop_the_run(tmp_path):
    stale = tmp_path / "predictions_2026-01-01_h100.json"
    stale.write_text(json.dumps({"written": "before the run; benchmarks/gpu_attention_backends.py, sources 0123",
                                 "code": "x", "rows": []}))
    with pytest.raises(SystemExit, match="predicts other sources"):
        gab.prediction_file(tmp_path, "h100")
    stale.unlink()
    path, held = gab.prediction_file(tmp_path, "h100")
    assert gab.prediction_file(tmp_path, "h100") == (path, held)
    assert gab.prediction_file(tmp_path, "a100")[0] is None  # no measured fractions: nothing to predict


def test_a_hung_worker_is_killed_with_a_timeout_line():
    t0 = time.monotonic()
    rows = gab.bounded([sys.executable, "-c", "import time; time.sleep(60)"], 1.0, "cudnn")
    assert time.monotonic() - t0 < 20
    assert rows == [{"backend": "cudnn", "kind": "error", "error": "TIMED OUT after 1 s: cudnn worker (killed)"}]


def test_steps_run_with_the_fastest_exact_backend():
    def speed(b, f, w):
        return {"backend": b, "kind": "speed", "tokens": gab.SPEED[1][0], "forward_tflops": f, "backward_tflops": w}

    rows = [speed("torch_flash", 360, 290), speed("cudnn", 600, 500), speed("cudnn_frontend", 650, 550),
            {"backend": "cudnn_frontend", "kind": "exact", "exact": False}]
    assert gab.fastest_exact(rows, ["torch_flash", "cudnn", "cudnn_frontend"]) == "cudnn"
    rows.append({"backend": "cudnn", "kind": "error", "error": "TIMED OUT"})
    assert gab.fastest_exact(rows, ["torch_flash", "cudnn", "cudnn_frontend"]) == "torch_flash"
