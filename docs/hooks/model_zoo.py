"""The model zoo's committed results, one row per model type: what the model-coverage page,
its figure and the searchable model list show.

Where it sits: reads benchmarks/results/zoo.json (every causal LM of transformers through
`patch()`, `benchmarks/zoo.py`) and benchmarks/results/vlm_zoo.json (every image-text-to-text
model type, `benchmarks/vlm_zoo.py`) as they are committed, so a re-measured file changes the
site without an edit. A causal LM's verdict is `benchmarks.zoo.overall` (the worst over the
two meshes, as zoo.md prints it). A vision-language family the library does not list (its
generic grid adapter measured as a candidate) is what the library does with it: REFUSED
(`vision_spec` refuses an unclassified family), the measurement as the cause."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ZOO = Path("benchmarks/results/zoo.json")
VLM_ZOO = Path("benchmarks/results/vlm_zoo.json")
VERDICTS = ("EXACT", "REFUSED", "WRONG", "CRASH", "SKIP")


@dataclass(frozen=True)
class Model:
    """One model type's row: its kind ("causal LM" / "vision-language"), verdict and cause
    (the refusal's message, the reason it was skipped, or the worst error when exact)."""

    kind: str
    model_type: str
    verdict: str
    cause: str


def _errors(errors: dict) -> str:
    """"loss 2.5e-07, gradient 3.5e-05" (relative): the worst over the meshes, or ""."""
    if not errors:
        return ""
    loss = max(e[0] for e in errors.values())
    grad = max(e[1] for e in errors.values())
    return f"loss {loss:.1e}, gradient {grad:.1e} of the largest (worst of {', '.join(sorted(errors))})"


def causal(root: Path) -> list[Model]:
    """Every causal LM of zoo.json, by model type."""
    from benchmarks.zoo import overall

    rows = json.loads((root / ZOO).read_text())
    return sorted((Model("causal LM", r["model_type"], overall(r), r.get("reason") or _errors(r.get("errors")))
                   for r in rows), key=lambda m: m.model_type)


def vision(root: Path) -> list[Model]:
    """Every image-text-to-text model type of vlm_zoo.json, by model type."""
    out = []
    for r in json.loads((root / VLM_ZOO).read_text()):
        verdict, cause = r["verdict"], r.get("reason") or _errors(r.get("errors"))
        if r.get("listed") is False and verdict in ("EXACT", "WRONG"):
            measured = "exact" if verdict == "EXACT" else "inexact"
            verdict, cause = "REFUSED", f"not listed: the generic grid adapter measured {measured} ({cause})"
        out.append(Model("vision-language", r["model_type"], verdict, cause))
    return sorted(out, key=lambda m: m.model_type)


def counts(models: list[Model]) -> dict[str, int]:
    """{verdict: model types}, every verdict, in VERDICTS' order."""
    return {v: sum(m.verdict == v for m in models) for v in VERDICTS}
