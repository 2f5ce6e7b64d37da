"""The backtest reads every GPU result and scores each row against the code it measured.

benchmarks/gpu_results.py: every file of benchmarks/results/ named by the rule is read, each row
with its card, date and code commit; a file that does not say them is listed unread with why.
benchmarks/gpu_backtest.py: a prediction written before a run (benchmarks/gpu_predictions.py)
is scored against the run recorded beside it. With the repository's history the backtest of
the committed results runs whole: the H100 record is modelled by the inventory of the code it
measured, the profiled configurations are the in-sample rows.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess

import pytest

from benchmarks import gpu_backtest
from benchmarks._model_at import ROOT
from benchmarks.gpu_predictions import record_run, write_predictions
from benchmarks.gpu_results import MEASURED, PREDICTED, RESULTS, read

ROWS = [dict(shape="8b", layers=2, preset="max+keep", tokens=32768), dict(shape="1b", layers=16, preset="max", tokens=32768)]


def test_every_results_file_is_read_with_its_code():
    r = read()
    named = {p.name for pattern in (MEASURED, PREDICTED) for p in RESULTS.glob(pattern)}
    sources = {x.source.split(":")[0] for x in r.measured + r.predicted}
    assert r.unread == [] and sources == named, (r.unread, named - sources)
    assert all(x.card in ("h100", "h200") and x.code and x.inventory and x.date for x in r.measured + r.predicted)
    (h100,) = [x for x in r.measured if x.card == "h100"]
    assert (h100.code, h100.inventory, round(h100.seconds, 3)) == ("ebc6829", "766ac1f", 2.747)


def test_a_file_that_does_not_say_its_code_is_unread(tmp_path):
    (tmp_path / "gpu_throughput_x_h200.json").write_text(json.dumps(
        [{"shape": "8b", "layers": 2, "preset": "max", "tokens": 32768, "fits": True, "seconds": 1.0}]))
    r = read(tmp_path)
    assert r.measured == [] and r.unread == [("gpu_throughput_x_h200.json", "no card, date, code (in the file or "
                                                                             "results/provenance.json)")]


def test_the_backtest_scores_each_prediction_against_its_run(tmp_path, monkeypatch):
    path = write_predictions(tmp_path, ROWS, "h200", code="abc1234", date="2030-01-02")
    predicted = json.loads(path.read_text())["rows"]
    record_run(path, [dict(r, fits=True, seconds=p["predicted_s"] * 1.1) for r, p in zip(ROWS, predicted)],
               code="abc1234", date="2030-01-03")
    # the model of the code the run measured is not evaluated here (that needs the commit in git)
    monkeypatch.setattr(gpu_backtest, "models_of_measured", lambda rows: ([{"error": "not here"}] * len(rows), {}))
    b = gpu_backtest.backtest(read(tmp_path))
    assert [round(x["error"], 6) for x in b["predictions"]] == [round(1 / 1.1 - 1, 6)] * 2
    assert {(x["run"].preset, x["sample"]) for x in b["rows"]} == {("max+keep", "out"), ("max", "in")}


def _has_history() -> bool:
    return shutil.which("git") is not None and all(
        subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{c}^{{commit}}"], capture_output=True).returncode == 0
        for c in ("766ac1f", "2765bd3"))


@pytest.fixture(scope="module")
def printed():
    if not _has_history():
        pytest.skip("needs the git history holding the measured code's inventories (766ac1f, 2765bd3)")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        b = gpu_backtest.print_backtest()
    return b, out.getvalue()


def test_each_run_is_modelled_by_the_inventory_of_the_code_it_measured(printed):
    b, _ = printed
    assert b["failed"] == {}
    (h100,) = [x for x in b["rows"] if x["run"].card == "h100"]
    assert h100["then"]["seconds"] == pytest.approx(2.597, abs=5e-4)  # 766ac1f's inventory: the code with its adds
    assert h100["now"]["predicted_s"] < h100["then"]["seconds"]  # today's inventory runs no chunk-gradient adds
    inside = {x["run"].config for x in b["rows"] if x["sample"] == "in"}
    assert inside == {("h200", "8b", 2, "max", 32768), ("h200", "1b", 16, "max", 32768)}
    assert all(abs(x["error"]) < 0.1 for x in b["rows"])


def test_the_gpu_page_shows_what_the_backtest_prints(printed):
    """docs/measured/gpu.md runs the backtest command and shows every row it prints; the README's
    headline row states its ranges and the predictions' errors."""
    from tests.helpers.doc_blocks import blocks_run_by

    b, out = printed
    page = "docs/measured/gpu.md"
    (command,) = blocks_run_by(page, "tests/unit/test_gpu_backtest.py::test_the_gpu_page_shows_what_the_backtest_prints")
    assert command.text.split() == ["PYTHONPATH=.", "python", "benchmarks/gpu_model.py", "--backtest"], command.text
    text = (ROOT / page).read_text()
    rows = [line for line in out.splitlines() if line.startswith("| ") and ("H100" in line or "H200" in line)]
    missing = [line for line in rows if line not in text]
    assert len(rows) == len(b["rows"]) + len(b["predictions"]) and not missing, missing
    readme = " ".join((ROOT / "README.md").read_text().split())
    for sample, name in (("out", "out of sample"), ("in", "in sample")):
        errs = [x["error"] for x in b["rows"] if x["sample"] == sample]
        lo, hi = 1 + min(errs), 1 + max(errs)
        assert f"{lo:.2f}–{hi:.2f}× the measured step time {name} ({len(errs)} rows" in readme or (
            f"{lo:.2f}–{hi:.2f}× {name} ({len(errs)} rows" in readme), (name, lo, hi, len(errs))
        assert f"-sample rows: {lo:.2f}..{hi:.2f} ({len(errs)} rows)" in text, (name, lo, hi)
    for x in b["predictions"]:
        assert f"{100 * x['error']:+.1f} %" in readme, x
