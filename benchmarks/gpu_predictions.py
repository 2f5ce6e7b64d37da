"""Predictions written before a GPU run, and the run's measurements recorded beside them.

Where it sits: between the step-time model (`capacity/step_time.py`) and a GPU run
(`benchmarks/gpu_throughput.py` rows, or a device script calling these functions). Before the
run, `write_predictions` stores what the model of the code as it is predicts for each row
(`predict_rows`) in `benchmarks/results/predictions_<date>_<card>.json`, with the commit that
predicted; after it, `record_run` stores the measured rows in
`gpu_throughput_<date>_<card>.json` beside it, each with its prediction and error, and the
file names the predictions it answers, which `--backtest` reports as out-of-sample.
Guarantees: a predictions file is never overwritten (a prediction made after the run is not
one); every row names its card, configuration and the code that predicted or ran it.

    from benchmarks.gpu_model import predict_rows, write_predictions, record_run
    rows = [dict(shape="8b", layers=2, preset="max+keep", tokens=131072)]
    path = write_predictions("benchmarks/results", rows, card="h100")      # commit it, then run
    record_run(path, measured_rows)                                        # gpu_throughput.py's rows
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
G = 2**30


def code_commit() -> str:
    """The working tree's commit ("<hash>+dirty" with uncommitted changes to tracked files;
    "unknown" without git, e.g. on a machine that received a copy of the tree)."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def predict_rows(rows: list[dict], card: str) -> list[dict]:
    """The model of the code as it is for each row on one `card` ("h100", "h200"): rows are
    {shape ("8b" | "1b", benchmarks/gpu_throughput.SHAPES), layers, preset ("off" | "balanced"
    | "high" | "max" | "max+keep"), tokens}, one document, one GPU, forward + backward. Each comes
    back with predicted_s, the seconds by term (attention_s, gemm_s, hbm_s, launches_s, links),
    kernels, binds and the strict MFU (capacity/mfu.py). Raises step_time.UntimedGPU for a card
    without measured kernel fractions."""
    from benchmarks.gpu_throughput import config
    from hf_longctx.capacity.cluster import Cluster
    from hf_longctx.capacity.estimate import ModelDims
    from hf_longctx.capacity.search import preset_setting
    from hf_longctx.capacity.step_time import step_time

    out = []
    for r in rows:
        dims = ModelDims.from_config(config(r["shape"], r["layers"]))
        preset, _, extra = r["preset"].partition("+")
        if extra not in ("", "keep"):
            raise ValueError(f"preset {r['preset']!r}: one of off, balanced, high, max, max+keep")
        s = dataclasses.replace(preset_setting(1, 1, 1, preset, dims), keep_attention=extra == "keep")
        b = step_time(dims, s, Cluster(1, 141e9, 2048 * G, gpu=card), r["tokens"])
        out.append(dict(shape=r["shape"], layers=r["layers"], preset=r["preset"], tokens=r["tokens"],
                        card=card.lower(), predicted_s=b.seconds, attention_s=b.attention, gemm_s=b.flops - b.attention,
                        hbm_s=b.hbm, launches_s=b.launches, links=dict(b.links), kernels=b.kernels, binds=b.binds,
                        mfu=b.mfu))
    return out


def write_predictions(path: str | Path, rows: list[dict], card: str, *, code: str | None = None,
                      date: str | None = None, note: str = "") -> Path:
    """Write `predict_rows(rows, card)` BEFORE the run to `path` (a directory: the file
    predictions_<date>_<card>.json in it; a file: its name must start "predictions_"), with
    the commit that predicts (`code`, default `code_commit()`) and the date (default today,
    UTC). Returns the file's path; refuses to overwrite one."""
    date = date or datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    path = Path(path)
    if path.is_dir() or not path.suffix:
        path = path / f"predictions_{date}_{card.lower()}.json"
    if not path.name.startswith("predictions_") or path.suffix != ".json":
        raise ValueError(f"{path.name}: a predictions file is predictions_<date>_<card>.json (gpu_results.py reads "
                         "no other name)")
    if path.exists():
        raise FileExistsError(f"{path} exists: a prediction is written once, before its run")
    data = {"kind": "predictions", "card": card.lower(), "date": date, "code": code or code_commit(),
            "written": "before the run, by benchmarks/gpu_predictions.write_predictions" + (f"; {note}" if note else ""),
            "model": "capacity/step_time.step_time of that code (one GPU, one document, forward + backward)",
            "rows": predict_rows(rows, card)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def record_run(predictions: str | Path, measured: list[dict], *, path: str | Path | None = None,
               code: str | None = None, device: str = "", date: str | None = None) -> Path:
    """After the run: `measured` (benchmarks/gpu_throughput.py's rows: shape, layers, preset,
    tokens, fits, seconds, ...) written beside `predictions` as gpu_throughput_<date>_<card>.json
    (or `path`), each row with its prediction and error (predicted / measured - 1), naming the
    predictions file and the code that ran (`code`, default `code_commit()`). Returns the path."""
    predictions = Path(predictions)
    pred = json.loads(predictions.read_text())
    key = lambda r: (r["shape"], int(r["layers"]), r["preset"], int(r["tokens"]))  # noqa: E731
    predicted = {key(r): r["predicted_s"] for r in pred["rows"]}
    rows = []
    for r in measured:
        row = dict(r)
        p = predicted.get(key(r))
        if p is not None and r.get("fits") and r.get("seconds"):
            row.update(predicted_s=p, error=p / r["seconds"] - 1)
        rows.append(row)
    date = date or datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    path = Path(path) if path else predictions.parent / f"gpu_throughput_{date}_{pred['card']}.json"
    if not path.name.startswith("gpu_throughput_"):
        raise ValueError(f"{path.name}: a measurement file is gpu_throughput_*.json (gpu_results.py reads no other name)")
    data = {"card": pred["card"], "date": date, "code": code or code_commit(), "device": device,
            "predictions": predictions.name, "rows": rows}
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path
