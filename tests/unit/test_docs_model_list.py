"""The model lists and the model counts the pages state, against the committed zoo results.

docs/hooks/model_list.py turns the model-coverage page's markers into a counts table and one
row per model type, from benchmarks/results/zoo.json and vlm_zoo.json (docs/hooks/model_zoo.py);
here the rendering is checked, and every count or family the pages write in prose
(docs/reference/support-matrix.md, docs/guides/vision-language.md, docs/measured/models.md: the
counts, the worst EXACT errors, the families called EXACT) is compared with the same files, so
a re-measured zoo shows which sentence to update."""

from __future__ import annotations

import json
import re

from tests.helpers.doc_blocks import ROOT
from tests.helpers.docs_hooks import hook

DOCS = ROOT / "docs"


def _text(page: str) -> str:
    return " ".join((DOCS / page).read_text().split())


def _counts(kind: str) -> dict[str, int]:
    zoo = hook("model_zoo")
    return zoo.counts(zoo.causal(ROOT) if kind == "causal" else zoo.vision(ROOT))


def test_the_markers_become_the_counts_and_one_row_per_model_type():
    lists = hook("model_list")
    page = (DOCS / "measured" / "models.md").read_text()
    assert all(f"<!-- model-{w}: {k} -->" in page for w in ("counts", "list") for k in ("causal", "vision"))
    out, unknown = lists.render(page, ROOT)
    assert unknown == [] and "<!-- model-" not in out
    tables = hook("page_tables")
    zoo = json.loads((ROOT / "benchmarks/results/zoo.json").read_text())
    vlm = json.loads((ROOT / "benchmarks/results/vlm_zoo.json").read_text())
    causal, vision = [t for t in tables.tables(out) if t.header[0] == "model type"]
    assert [c.strip("`") for c in causal.column("model type")] == sorted(r["model_type"] for r in zoo)
    assert [c.strip("`") for c in vision.column("model type")] == sorted(r["model_type"] for r in vlm)
    counts = [t for t in tables.tables(out) if t.header == ("verdict", "model types")]
    assert [int(t.rows[-1][1]) for t in counts] == [len(zoo), len(vlm)]
    assert all(sum(int(n) for _, n in t.rows[:-1]) == int(t.rows[-1][1]) for t in counts)
    bert = next(r for r in zoo if r["model_type"] == "bert")
    refused = next(r for r in causal.records() if r["model type"] == "`bert`")
    assert refused["verdict"] == "REFUSED" and refused["cause, or the worst error when exact"] == lists._cell(bert["reason"])
    assert lists.render("<!-- model-list: nothing -->", ROOT)[1] == ["<!-- model-list: nothing -->"]


def test_the_support_matrix_states_the_zoo_counts():
    causal, vision = _counts("causal"), _counts("vision")
    text = _text("reference/support-matrix.md")
    said = re.search(r"(\d+) of the (\d+) causal LMs of transformers [\d.]+ EXACT on Ulysses and ring, (\d+) refused "
                     r"with the cause, (\d+) wrong, (\d+) crashing", text)
    assert said, "the support matrix's model row is gone"
    assert tuple(int(x) for x in said.groups()) == (causal["EXACT"], sum(causal.values()), causal["REFUSED"],
                                                    causal["WRONG"], causal["CRASH"])
    said = re.search(r"(\d+) of the (\d+) image-text-to-text model types EXACT, (\d+) refused with the cause", text)
    assert said and tuple(int(x) for x in said.groups()) == (vision["EXACT"], sum(vision.values()), vision["REFUSED"])


def test_the_vision_guide_states_the_zoo_counts():
    vision = _counts("vision")
    said = re.search(r"(\d+) of the (\d+) image-text-to-text model types of transformers [\d.]+ are EXACT \(.*?\), "
                     r"(\d+) refused with the cause", _text("guides/vision-language.md"))
    assert said and tuple(int(x) for x in said.groups()) == (vision["EXACT"], sum(vision.values()), vision["REFUSED"])


def test_the_coverage_page_states_the_worst_exact_errors():
    from benchmarks.zoo import overall

    exact = [e for r in json.loads((ROOT / "benchmarks/results/zoo.json").read_text()) if overall(r) == "EXACT"
             for e in r["errors"].values()]
    said = re.search(r"worst EXACT errors: loss ([\d.e+-]+), gradient ([\d.e+-]+) of the largest", _text("measured/models.md"))
    assert said and said.groups() == (f"{max(e[0] for e in exact):.1e}", f"{max(e[1] for e in exact):.1e}")


def test_the_families_the_coverage_page_calls_exact_are_exact():
    zoo = hook("model_zoo")
    verdict = {m.model_type: m.verdict for m in zoo.causal(ROOT)}
    said = re.search(r"The attention-sink families \(([^)]*)\) and the hybrids \(([^)]*)\) are EXACT",
                     _text("measured/models.md"))
    assert said, "the coverage page's sentence on the sink families and hybrids is gone"
    named = [n.strip() for group in said.groups() for n in group.split(",")]
    assert len(named) > 10 and {n: verdict.get(n) for n in named if verdict.get(n) != "EXACT"} == {}


def test_the_readme_states_the_zoo_counts():
    causal, vision = _counts("causal"), _counts("vision")
    text = " ".join((ROOT / "README.md").read_text().split())
    said = re.search(r"(\d+) of the (\d+) causal LMs of transformers ([\d.]+) exact on Ulysses and ring, (\d+) refused "
                     r"with the cause, (\d+) wrong", text)
    assert said, "the README's model-family row is gone"
    version = re.search(r"on transformers (\d+\.\d+)", (ROOT / "benchmarks/results/zoo.md").read_text()).group(1)
    n_exact, n_all, said_version, n_refused, n_wrong = said.groups()
    assert (int(n_exact), int(n_all), int(n_refused), int(n_wrong)) == (
        causal["EXACT"], sum(causal.values()), causal["REFUSED"], causal["WRONG"])
    said = re.search(r"\| causal LMs of transformers ([\d.]+) \| (\d+) exact, (\d+) refused with the cause, (\d+) wrong, "
                     r"(\d+) crashing", text)
    assert said and tuple(int(x) for x in said.groups()[1:]) == (causal["EXACT"], causal["REFUSED"], causal["WRONG"],
                                                                 causal["CRASH"])
    said = re.search(r"(\d+) of the (\d+) image-text-to-text model types", text)
    assert said and tuple(int(x) for x in said.groups()) == (vision["EXACT"], sum(vision.values()))
    assert said_version == version, f"the README names transformers {said_version}, the zoo ran {version}"
