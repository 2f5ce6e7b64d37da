"""Processes started like a cluster job, and always stopped: agents in their own process groups.

`start(cmd, log)` starts one launcher agent (`torchrun ...`) as the leader of a new session, so
the agent and every worker it spawns share one process group; `wait_all(procs, timeout_s)` waits
for every agent until a common deadline and, if any is still running then, kills each group
(SIGKILL to the whole group: workers blocked in a collective included) and raises. A test built
on it can fail but never hang CI. `free_port()` is a port nothing listens on now.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from typing import IO


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], log: IO, env: dict[str, str], cwd: str) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the session leader's pid is the group id
    except ProcessLookupError:
        pass
    proc.wait()


def wait_all(procs: list[subprocess.Popen], timeout_s: float) -> list[int]:
    """Exit codes of `procs`; past `timeout_s` every process group is killed and TimeoutError raised."""
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            kill_group(p)
        raise TimeoutError(f"launch did not finish within {timeout_s:.0f}s; every process group was killed") from None
    finally:
        for p in procs:  # an agent that exited may leave workers behind in its group
            if p.returncode is not None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    return [p.returncode for p in procs]
