"""benchmarks/gpu_check.py on CPU: the verdict, and the bounds.

With a CPU torch it exits 0 on a machine without an NVIDIA device and FAILS when
/dev/nvidia0 exists (a CPU wheel on a GPU machine validates nothing); the device probe is
injected and the pytest / script subprocesses are stubs, so only the verdict logic runs.
Every subprocess of the check and every rank of a multi-rank benchmark is bounded: a hung
one is killed and reported by one "TIMED OUT after N s" line, and the check fails -- shown
here with a real hung subprocess and real hung ranks, each ended well inside the test's own
limit."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from benchmarks import gpu_check
from benchmarks._ranks import run_ranks


@pytest.fixture
def quiet_steps(monkeypatch):
    monkeypatch.setattr(gpu_check, "_pytest", lambda *a: (0, "3 passed"))
    monkeypatch.setattr(gpu_check, "run", lambda *a: (0, "ok", ""))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the verdict for a torch that sees no CUDA device")
@pytest.mark.parametrize("nvidia_device,code", [(False, 0), (True, 1)])
def test_cpu_torch_fails_only_where_an_nvidia_device_exists(quiet_steps, capsys, nvidia_device, code):
    assert gpu_check.main(["--skip-bench"], nvidia_device=nvidia_device) == code
    out = capsys.readouterr().out
    assert ("FAILED: /dev/nvidia0 exists" in out) == nvidia_device
    assert ("none visible" in out) == (not nvidia_device)
    assert "| check | result |" in out  # the table for the README


def test_a_hung_subprocess_is_killed_with_a_timeout_line(capsys):
    t0 = time.monotonic()
    code, line, _ = gpu_check.run([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(120)"],
                                  2, "a hung step")
    assert time.monotonic() - t0 < 30
    assert code is None and line == "TIMED OUT after 2 s: a hung step (killed)"
    out = capsys.readouterr().out
    assert "started" in out and "TIMED OUT after 2 s: a hung step" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of the check")
def test_the_check_fails_on_a_hung_step_inside_its_bound(monkeypatch, capsys):
    hung = "tests/unit/test_backends.py"
    real = gpu_check.run

    def pytest_or_hang(args, timeout, what):
        if hung in args:  # this step hangs: the check must end it at its bound
            return real([sys.executable, "-c", "import time; time.sleep(120)"], 2, what)[:2]
        return 0, "ok"

    monkeypatch.setattr(gpu_check, "_pytest", pytest_or_hang)
    monkeypatch.setattr(gpu_check, "run", lambda cmd, timeout, what: (0, "ok", "") if "hot_path" in what else real(cmd, timeout, what))
    t0 = time.monotonic()
    assert gpu_check.main(["--skip-bench"], nvidia_device=False) == 1
    assert time.monotonic() - t0 < 30
    out = capsys.readouterr().out
    assert "FAILED: TIMED OUT after 2 s: tests/unit/test_backends.py (killed)" in out


def _hung(rank, init_file, args, results):
    time.sleep(600)


def test_hung_benchmark_ranks_end_with_a_timeout_line():
    t0 = time.monotonic()
    with pytest.raises(SystemExit, match=r"TIMED OUT after 3s: ranks \[0, 1\] of 2 running _hung did not finish"):
        run_ranks(_hung, 2, None, timeout=3)
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("case", ["local kernel", "memory='max' (u=4)", "conv: LFM2"])
def test_sync_step_configurations_run_on_cpu(case):
    """benchmarks/gpu_sync_step.py's calls on CPU (without the CUDA sync check): a wiring error
    fails here, not on the GPU machine."""
    from benchmarks.gpu_sync_step import CASES, run_case

    label, options, chunks, family = next(c for c in CASES if c[0] == case)
    ok, text = run_case(label, options, chunks, family, tokens=256, device="cpu")
    assert ok and text.startswith("0 syncs"), text
