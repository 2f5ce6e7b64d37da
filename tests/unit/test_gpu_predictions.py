"""Predictions written before a GPU run, and the run recorded beside them (benchmarks/gpu_predictions.py).

A predictions file is written once, under the name benchmarks/gpu_results.py reads, with the
commit that predicted; `record_run` writes the measurements beside it, each row with its
prediction and error, naming the predictions file; a card without measured kernel fractions
gets no prediction.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.gpu_predictions import predict_rows, record_run, write_predictions
from benchmarks.gpu_results import read

ROWS = [dict(shape="8b", layers=2, preset="max+keep", tokens=32768), dict(shape="1b", layers=16, preset="max", tokens=32768)]


def test_predictions_before_the_run_and_the_run_beside_them(tmp_path):
    path = write_predictions(tmp_path, ROWS, "h100", code="abc1234", date="2030-01-02")
    assert path.name == "predictions_2030-01-02_h100.json"
    with pytest.raises(FileExistsError):
        write_predictions(tmp_path, ROWS, "h100", code="abc1234", date="2030-01-02")
    with pytest.raises(ValueError, match="predictions_<date>_<card>.json"):
        write_predictions(tmp_path / "guess.json", ROWS, "h100")
    predicted = json.loads(path.read_text())["rows"]
    assert [p["predicted_s"] for p in predicted] == [p["predicted_s"] for p in predict_rows(ROWS, "h100")]
    measured = [dict(r, fits=True, seconds=p["predicted_s"] * 1.1) for r, p in zip(ROWS, predicted)]
    run = record_run(path, measured, code="abc1234", device="test", date="2030-01-03")
    assert run.name == "gpu_throughput_2030-01-03_h100.json"
    assert all(r["error"] == pytest.approx(1 / 1.1 - 1) for r in json.loads(run.read_text())["rows"])
    r = read(tmp_path)
    assert r.unread == [] and {x.predictions for x in r.measured} == {path.name}
    assert [x.seconds for x in r.predicted] == [p["predicted_s"] for p in predicted]


def test_predictions_refuse_a_card_without_fractions():
    from hf_longctx.capacity.step_time import UntimedGPU

    with pytest.raises(UntimedGPU):
        predict_rows(ROWS[:1], "a100")
