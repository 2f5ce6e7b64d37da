"""The bound of the launched tests (tests/helpers/launcher.py): an agent that never finishes is
killed at the deadline together with the workers it started, and the test fails instead of
hanging CI. Here the "agent" starts a worker that sleeps, then sleeps itself."""

from __future__ import annotations

import os
import sys
import time

import pytest

from tests.helpers.launcher import start, wait_all

AGENT = (
    "import subprocess, sys, time\n"
    "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "open(sys.argv[1], 'w').write(str(w.pid))\n"
    "time.sleep(600)\n"
)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)  # killed, not yet reaped
    except FileNotFoundError:
        return True


def test_a_hung_launch_is_killed_with_its_workers(tmp_path):
    pid_file = tmp_path / "worker.pid"
    with open(tmp_path / "agent.log", "w") as log:
        agent = start([sys.executable, "-c", AGENT, str(pid_file)], log, dict(os.environ), str(tmp_path))
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        worker = int(pid_file.read_text())
        with pytest.raises(TimeoutError, match="every process group was killed"):
            wait_all([agent], timeout_s=1)
    assert agent.returncode is not None
    deadline = time.monotonic() + 10
    while not _gone(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(worker), f"worker {worker} survived its agent's kill"
