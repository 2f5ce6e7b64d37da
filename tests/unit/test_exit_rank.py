"""`exit_rank` / `run_rank` (training/launch.py): a launched rank leaves without interpreter
finalisation, yet keeps what finalisation would have done for the user -- atexit handlers run,
buffered stdout/stderr reach the pipe, non-daemon threads finish, the exit code is the one asked
for -- and a failing `main` still ends the process the usual way (traceback, exit code).

The abort it avoids (a gloo worker killed by `Py_FinalizeEx` while releasing a collective's
tensors) is a race that needs loaded cores; tests/integration/test_demo.py and the DPO / GRPO
recipe tests run the launched recipes without a retry, so it would show there. Here a probe
proves finalisation is skipped: an object whose `__del__` writes a marker at interpreter
teardown writes nothing after `exit_rank`, and does after a plain exit.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PRELUDE = textwrap.dedent(
    """
    import atexit, os, threading, time
    from hf_longctx.training.launch import exit_rank, run_rank

    class Teardown:  # reached only by interpreter finalisation (module globals are cleared there)
        def __del__(self, write=os.write):
            write(2, b"FINALISED\\n")

    probe = Teardown()
    atexit.register(lambda: print("ATEXIT", flush=False))

    def slow_worker():
        time.sleep(0.3)
        print("WORKER DONE", end="")

    threading.Thread(target=slow_worker).start()
    """
)


def _run(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                          timeout=120)


def test_exit_rank_keeps_atexit_threads_buffers_and_code_but_skips_finalisation():
    proc = _run('print("BUFFERED", end="")\nexit_rank(3)\n')
    assert proc.returncode == 3, proc.stderr
    assert "BUFFERED" in proc.stdout and "WORKER DONE" in proc.stdout and "ATEXIT" in proc.stdout, proc.stdout
    assert "FINALISED" not in proc.stderr, proc.stderr


def test_plain_exit_finalises_so_the_probe_can_tell():
    proc = _run('print("BUFFERED", end="")\n')
    assert proc.returncode == 0, proc.stderr
    assert "FINALISED" in proc.stderr, proc.stderr  # the probe sees finalisation when it happens


@pytest.mark.parametrize("raise_line, code, shown", [
    ("raise ValueError('bad shard 7')", 1, "ValueError: bad shard 7"),
    ("raise SystemExit(2)", 2, ""),
])
def test_run_rank_lets_a_failing_main_end_the_process_as_usual(raise_line, code, shown):
    proc = _run(f"def main():\n    {raise_line}\nrun_rank(main)\n")
    assert proc.returncode == code, proc.stderr
    assert shown in proc.stderr
    assert "ATEXIT" in proc.stdout  # the normal exit path, atexit included
