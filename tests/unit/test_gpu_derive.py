"""capacity/gpus.py holds what the committed H200 profiles give (benchmarks/gpu_derive.py).

The derivation sets each profile's kernel times (benchmarks/results/gpu_throughput_*_h200.json)
against the work the inventory of the profiled code counts (the inventory at 766ac1f, taken
out of git by benchmarks/_model_at.py), so it needs the repository's history; without it the
test says so and skips. A constant edited away from its rule fails here, naming it.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess

import pytest

from benchmarks._model_at import ROOT


def _has(commit: str) -> bool:
    if shutil.which("git") is None:
        return False
    return subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"],
                          capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not (_has("766ac1f") and _has("2765bd3")),
                                reason="needs the git history holding the profiled code's inventory (766ac1f, 2765bd3)")


@pytest.fixture(scope="module")
def derived():
    from benchmarks.gpu_derive import derive

    return derive()


def test_gpus_py_reproduces_the_profiles(derived):
    from benchmarks.gpu_derive import mismatches

    assert mismatches(derived) == []
    assert derived["gemm"]["8b"] == pytest.approx(0.692, abs=5e-4)
    assert {k: v[1:] for k, v in derived["hbm"].items()} == {"8b": (374, 374), "1b": (2302, 2302)}  # adds matched


def test_a_drifted_constant_is_named(derived):
    from benchmarks.gpu_derive import mismatches
    from hf_longctx.capacity.gpus import GPUS

    drifted = dataclasses.replace(GPUS["h200"], gemm=0.72, hbm=0.6, pcie_h2d=65e9)
    bad = " ".join(mismatches(derived, drifted))
    assert "gemm 0.72" in bad and "hbm 0.6" in bad and "pcie_h2d 65" in bad, bad


def test_the_code_as_it_is_checks_the_elementwise_fraction(derived):
    """The elementwise constant came from a kernel the code as it is does not run; the profile of the
    code as it is (its own inventory) gives the same fraction within 0.01."""
    from hf_longctx.capacity.gpus import GPUS

    assert derived["checks"]["hbm"] == pytest.approx(GPUS["h200"].hbm, abs=0.01)


def test_the_gpu_page_shows_the_derivation(derived, capsys):
    """docs/measured/gpu.md runs `--derive` and shows what it prints, line for line."""
    from benchmarks.gpu_derive import print_derivation
    from tests.helpers.doc_blocks import blocks_run_by

    command, output = blocks_run_by("docs/measured/gpu.md",
                                    "tests/unit/test_gpu_derive.py::test_the_gpu_page_shows_the_derivation")
    assert command.text.split() == ["PYTHONPATH=.", "python", "benchmarks/gpu_model.py", "--derive"], command.text
    print_derivation(derived)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert printed == [line for line in output.text.splitlines() if line.strip()]
