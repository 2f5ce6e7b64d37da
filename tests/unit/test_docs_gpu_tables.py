"""The GPU page's tables that a committed file or a seconds-long CPU computation prints, held
to it (docs/measured/gpu.md).

The H200 throughput table is benchmarks/results/gpu_throughput_{8b,1b}_h200.json as
`benchmarks/gpu_throughput.py` prints it (step s, tokens/s, MFU at 989 TFLOP/s, peak GiB); the
step-time backtest table and the derived fractions are what `benchmarks/gpu_model.py
--backtest` and `--derive` print today (the step-time model on CPU, seconds). The page's
pictures are drawn from these tables (docs/hooks/figures_pages.py)."""

from __future__ import annotations

import contextlib
import io
import json

from tests.helpers.doc_blocks import ROOT, blocks_run_by
from tests.helpers.docs_hooks import hook

PAGE = "docs/measured/gpu.md"
HERE = "tests/unit/test_docs_gpu_tables.py::"
find = hook("page_tables").find


def _page() -> str:
    return (ROOT / PAGE).read_text()


def test_the_throughput_table_is_the_committed_rows():
    from benchmarks.gpu_throughput import config, model_flops

    want = []
    for name in ("gpu_throughput_8b_h200.json", "gpu_throughput_1b_h200.json"):
        for r in json.loads((ROOT / "benchmarks" / "results" / name).read_text()):
            if "profile" in r:
                continue
            head = [r["shape"].upper(), str(r["layers"]), r["preset"], f"{r['tokens']:,}"]
            if not r.get("fits"):
                want.append(head + ["out of memory", "", "", ""])
                continue
            mfu = model_flops(config(r["shape"], r["layers"]), r["tokens"]) / r["seconds"] / 989e12
            want.append(head + [f"{r['seconds']:.3f}", f"{r['tokens'] / r['seconds']:,.0f}", f"{100 * mfu:.1f} %",
                                f"{r['peak_gib']:.1f}"])
    table = find(_page(), "widths", "layers", "memory", "tokens", "step s", "tokens/s", "MFU", "peak GiB")
    assert [list(row) for row in table.rows] == want


def test_the_backtest_table_is_what_the_model_prints():
    from benchmarks.gpu_model import backtest

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        backtest()
    printed = find(out.getvalue(), "card", "measured s", "model s")
    shown = find(_page(), "card", "measured s", "model s")
    assert shown.header == printed.header
    assert shown.rows == printed.rows, [(a, b) for a, b in zip(shown.rows, printed.rows) if a != b]


def test_the_derived_fractions_are_what_the_model_prints():
    from benchmarks.gpu_model import derive

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        derive()
    printed = {line.strip() for line in out.getvalue().splitlines()}
    (block,) = blocks_run_by(PAGE, HERE + "test_the_derived_fractions_are_what_the_model_prints")
    shown = [line.strip() for line in block.text.splitlines() if line.strip()]
    assert shown and [line for line in shown if line not in printed] == []
