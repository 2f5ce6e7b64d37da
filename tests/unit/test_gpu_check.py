"""benchmarks/gpu_check.py's verdict on CPU: with a CPU torch it exits 0 on a machine
without an NVIDIA device and FAILS when /dev/nvidia0 exists (a CPU wheel on a GPU machine
validates nothing). The device probe is injected; the pytest / script subprocesses are
replaced by stubs so only the verdict logic runs."""

from __future__ import annotations

import pytest
import torch

from benchmarks import gpu_check


@pytest.fixture
def quiet_steps(monkeypatch):
    monkeypatch.setattr(gpu_check, "_pytest", lambda *a: 0)
    monkeypatch.setattr(gpu_check, "_pytest_summary", lambda *a: (0, "3 tests collected"))
    monkeypatch.setattr(gpu_check, "_script", lambda *a: ("ok", False))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the verdict for a torch that sees no CUDA device")
@pytest.mark.parametrize("nvidia_device,code", [(False, 0), (True, 1)])
def test_cpu_torch_fails_only_where_an_nvidia_device_exists(quiet_steps, capsys, nvidia_device, code):
    assert gpu_check.main(["--skip-bench"], nvidia_device=nvidia_device) == code
    out = capsys.readouterr().out
    assert ("FAILED: /dev/nvidia0 exists" in out) == nvidia_device
    assert ("none visible" in out) == (not nvidia_device)
