"""Every GPU measurement and prediction in benchmarks/results/, read by one naming rule.

Where it sits: under `benchmarks/gpu_model.py --backtest` (and `--derive`, which reads the
profiled rows). The rule: `gpu_throughput_*.json` holds measured steps, `predictions_*.json`
(`predictions_<date>_<card>.json`, written by `gpu_predictions.write_predictions` before a
run) holds predicted ones; nothing else there is a GPU result. A measurement file is either
`benchmarks/gpu_throughput.py --json`'s list of rows, or an object whose list-valued keys are
groups of rows and whose other keys (card, date, code, inventory, predictions, ...) describe
them; what a file does not say is read from `results/provenance.json` (per file, per group).
Guarantees: every row comes back with the card, the date, the code commit it ran and the
commit whose inventory models that code; a file or group missing one of those is returned as
unread, with why, never skipped silently. Profiled steps (torch.profiler on) are kept apart.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
MEASURED, PREDICTED = "gpu_throughput_*.json", "predictions_*.json"
DESCRIBED = ("card", "date", "code")  # what every group of rows must have, from the file or its provenance


@dataclass(frozen=True)
class Row:
    """One configuration of one run: the step's seconds measured (or predicted)."""

    card: str
    shape: str
    layers: int
    preset: str
    tokens: int
    seconds: float
    code: str  # the commit the run measured (a prediction: the commit that predicted)
    inventory: str  # the commit whose capacity/inventory.py models `code`
    date: str
    source: str  # "file" or "file:group"
    profiled: bool = False
    predictions: str = ""  # the predictions file written before this run, if any
    notes: dict = field(default_factory=dict, compare=False)

    @property
    def config(self) -> tuple:
        return self.card, self.shape, self.layers, self.preset, self.tokens


@dataclass
class Results:
    measured: list = field(default_factory=list)  # Row, profiled ones included (`Row.profiled`)
    predicted: list = field(default_factory=list)  # Row, seconds predicted
    unread: list = field(default_factory=list)  # (source, why)
    profiles: list = field(default_factory=list)  # (Row, the profile dict)


def _groups(data) -> dict:
    """{group name: rows} of a file's content (a bare list is one group named "")."""
    if isinstance(data, list):
        return {"": data}
    return {k: v for k, v in data.items() if isinstance(v, list) and all(isinstance(r, dict) for r in v)}


def _describe(data, provenance: dict, name: str, group: str) -> dict:
    """The keys that describe a group: the file's own, then its provenance, then the group's."""
    meta = {k: v for k, v in data.items() if not isinstance(v, list)} if isinstance(data, dict) else {}
    extra = provenance.get(name, {})
    meta.update({k: v for k, v in extra.items() if k != "groups"})
    meta.update(extra.get("groups", {}).get(group, {}))
    return meta


def read(results: Path = RESULTS) -> Results:
    """Every measurement and prediction file of `results` (see the module docstring)."""
    out = Results()
    provenance_file = results / "provenance.json"
    provenance = json.loads(provenance_file.read_text()) if provenance_file.exists() else {}
    for path in sorted(results.glob(MEASURED)):
        data = json.loads(path.read_text())
        groups = _groups(data)
        if not groups:
            out.unread.append((path.name, "no list of rows in it"))
        for group, rows in groups.items():
            source = f"{path.name}:{group}" if group not in ("", "rows") else path.name
            meta = _describe(data, provenance, path.name, group)
            missing = [k for k in DESCRIBED if not meta.get(k)]
            if missing:
                out.unread.append((source, f"no {', '.join(missing)} (in the file or results/provenance.json)"))
                continue
            for r in rows:
                if not r.get("fits") or r.get("seconds") is None:
                    continue
                row = Row(meta["card"].lower(), r["shape"], int(r["layers"]), r["preset"], int(r["tokens"]),
                          float(r["seconds"]), str(meta["code"]), str(meta.get("inventory") or meta["code"]),
                          str(meta["date"]), source, "profile" in r, meta.get("predictions", ""),
                          {k: v for k, v in meta.items() if k.endswith("note")})
                out.measured.append(row)
                if "profile" in r:
                    out.profiles.append((row, r["profile"]))
    for path in sorted(results.glob(PREDICTED)):
        data = json.loads(path.read_text())
        missing = [k for k in DESCRIBED if not data.get(k)]
        if missing or not isinstance(data.get("rows"), list):
            out.unread.append((path.name, f"no {', '.join(missing) or 'rows'}"))
            continue
        for r in data["rows"]:
            out.predicted.append(Row(data["card"].lower(), r["shape"], int(r["layers"]), r["preset"], int(r["tokens"]),
                                     float(r["predicted_s"]), str(data["code"]), str(data.get("inventory") or data["code"]),
                                     str(data["date"]), path.name, notes={"written": data.get("written", "")}))
    return out


def best_runs(rows: list) -> list:
    """One row per (configuration, code, source): the fastest of the repeats a file holds
    (steps timed best-of-N; the profiled step apart: the profiler's overhead is in it)."""
    best: dict = {}
    for r in rows:
        if r.profiled:
            continue
        key = (*r.config, r.code, r.source)
        if key not in best or r.seconds < best[key].seconds:
            best[key] = r
    return list(best.values())
