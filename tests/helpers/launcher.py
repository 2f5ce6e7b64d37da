"""Processes started like a cluster job, and always stopped: agents in their own process groups.

`start(cmd, log)` starts one launcher agent (`torchrun ...`) as the leader of a new session, so
the agent and every worker it spawns share one process group; `wait_all(procs, timeout_s)` waits
for every agent until a common deadline and, if any is still running then, kills each group
(SIGKILL to the whole group: workers blocked in a collective included) and raises. A test built
on it can fail but never hang CI. `free_port()` is a port nothing listens on now.

`run_agents(script_args, log_dir, nodes=2, procs=2)` is a multi-node job on this machine: one
`torchrun --nnodes N --nproc-per-node P` agent per node, each its own process group, meeting
through a c10d rendezvous on 127.0.0.1 at a free port (agent 0 hosts the store: `is_host`),
with the repository on PYTHONPATH and one thread per rank; `nodes=1` is the same job under one
agent. It returns every agent's exit code and log.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import IO

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def agents_env() -> dict[str, str]:
    """This environment for launched agents: the repository first on PYTHONPATH, one thread per rank,
    and none of an enclosing launch's rank variables (each agent sets its workers' own)."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def run_agents(script_args: list[str], log_dir, *, nodes: int = 2, procs: int = 2, cwds: list[str] | None = None,
               timeout_s: float = 300) -> tuple[list[int], list[str]]:
    """(exit code, log) of each of `nodes` torchrun agents of `procs` ranks running `script_args`
    (the script and its arguments), agent n in cwds[n] (default: the repository) writing
    log_dir/agent<n>.log; past `timeout_s` every agent's process group is killed (TimeoutError)."""
    port, agents, logs = free_port(), [], []
    for node in range(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", str(procs),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "hf_longctx_agents",
               "--rdzv-conf", f"is_host={int(node == 0)},join_timeout=240", "--max-restarts", "0", *script_args]
        logs.append(open(os.path.join(log_dir, f"agent{node}.log"), "w"))
        agents.append(start(cmd, logs[-1], agents_env(), cwds[node] if cwds else ROOT))
    try:
        codes = wait_all(agents, timeout_s=timeout_s)
    finally:
        for f in logs:
            f.close()
    texts = []
    for node in range(nodes):
        with open(os.path.join(log_dir, f"agent{node}.log")) as f:
            texts.append(f.read())
    return codes, texts
