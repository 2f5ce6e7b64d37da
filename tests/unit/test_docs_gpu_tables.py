"""The GPU page's tables that a committed file or a seconds-long CPU computation prints, held
to it (docs/measured/gpu.md).

The H200 throughput table is benchmarks/results/gpu_throughput_{8b,1b}_h200.json as
`benchmarks/gpu_throughput.py` prints it (step s, tokens/s, MFU at 989 TFLOP/s, peak GiB); the
step-time backtest table and the derived fractions are held by tests/unit/test_gpu_backtest.py
and test_gpu_derive.py. The page's pictures are drawn from these tables
(docs/hooks/figures_pages.py)."""

from __future__ import annotations

import json

from tests.helpers.doc_blocks import ROOT
from tests.helpers.docs_hooks import hook

PAGE = "docs/measured/gpu.md"
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
