"""The modelled targets (benchmarks/gpu_targets.py) model what they say, and say which fractions are assumed.

Each target is printed twice: with the flash-attn fractions measured here (capacity/gpus.py) and
with FlashAttention-3-class ones assumed from the literature; the assumed rows change the
attention kernels' time and nothing else, and say ASSUMED. The settings are the ones the
targets name (`max` + keep_attention at 128K on one H100; one 1M-token sequence over 8 H100s).
Whether a target is met is printed, never asserted.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def rows():
    from benchmarks.gpu_targets import targets

    return targets()


def test_the_targets_model_the_settings_they_name(rows):
    one = [r for r in rows if "128K" in r["target"]]
    eight = [r for r in rows if "1M" in r["target"]]
    assert len(one) == len(eight) == 2
    assert all(r["candidate"].preset == "max" and r["candidate"].setting.keep_attention for r in one)
    assert all(r["candidate"].setting.sp == 8 and r["candidate"].dp == 1 for r in eight)


def test_only_the_assumed_rows_assume_and_only_attention_moves(rows):
    from hf_longctx.capacity.gpus import GPUS

    for target in {r["target"] for r in rows}:
        measured, assumed = sorted((r for r in rows if r["target"] == target), key=lambda r: "ASSUMED" in r["kernels"])
        assert "ASSUMED" in assumed["kernels"] and "measured" in measured["kernels"]
        assert measured["candidate"].time.gpu.attention == GPUS["h100"].attention
        a, m = assumed["candidate"].time, measured["candidate"].time
        if assumed["candidate"].setting == measured["candidate"].setting:
            assert (a.flops - a.attention, a.hbm) == pytest.approx((m.flops - m.attention, m.hbm))
            assert a.attention < m.attention


def test_the_gpu_page_shows_the_targets(rows, capsys):
    """docs/measured/gpu.md runs `--targets` and shows every row it prints."""
    from benchmarks.gpu_targets import print_targets
    from tests.helpers.doc_blocks import ROOT, blocks_run_by

    (command,) = blocks_run_by("docs/measured/gpu.md", "tests/unit/test_gpu_targets.py::test_the_gpu_page_shows_the_targets")
    assert command.text.split() == ["PYTHONPATH=.", "python", "benchmarks/gpu_model.py", "--targets"], command.text
    print_targets(rows)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "H100" in line]
    text = (ROOT / "docs" / "measured" / "gpu.md").read_text()
    assert len(printed) == 4 and not [line for line in printed if line not in text], printed
