"""`make gpu-check`: validate a GPU machine in one command, bounded, and print one table.

On CUDA (default bound: about 5 minutes on one H100): every CUDA-only test (tests/gpu: fast
kernels vs the math kernel, the offload double buffer with real streams;
tests/unit/test_offload.py's pinned side-stream copies); with more than one GPU the multi-GPU
NCCL tests (tests/gpu/test_multi_gpu.py: FSDP2 bf16, Ulysses / ring / FPDT exact against one
GPU, the Trainer, flexible groups) as their own row; patched steps under
`torch.cuda.set_sync_debug_mode("error")` (benchmarks/gpu_sync_step.py: no host sync in a
step, by CUDA's own account, one row per configuration); the emulated-backend tests; the GPU
benchmark (benchmarks/gpu_longctx.py) up to `--max-tokens` (default 32K; `--max-tokens
262144` for the longest-context probe of the README), skipped with the reason when no fast
attention kernel serves bf16 (it would time the math kernel). On a CPU machine: collects
every CUDA-marked test and imports the GPU benchmark (so a broken import or signature fails
here too), runs the emulated-backend tests and benchmarks/hot_path.py (host syncs and ops per
layer on the emulated CUDA dispatch path), says there is no GPU and exits 0 -- unless an
NVIDIA device node (/dev/nvidia0) exists: then the torch installed is a CPU build (or cannot
see the driver) on a GPU machine, and the check FAILS instead of validating nothing.

Every subprocess runs under a timeout; one that passes it is killed and its row says
"TIMED OUT after N s" (a hung rank of a multi-GPU test, a probe stuck in a kernel), and the
check fails.

Run: python benchmarks/gpu_check.py [--skip-bench] [--max-tokens 32768] [--hot-path]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import subprocess
import sys
from pathlib import Path

import torch

NVIDIA_DEVICE = "/dev/nvidia0"
HERE = Path(__file__).resolve().parent
# seconds per subprocess: generous for one H100 (each takes a fraction of it), so a timeout means a hang
TIMEOUTS = {"collect": 180, "emulated": 300, "hot_path": 900, "cuda_tests": 420, "multi_gpu": 900, "sync_step": 300,
            "probe": 240}
DEFAULT_MAX_TOKENS = 1 << 15


def run(cmd: list[str], timeout: float, what: str) -> tuple[int | None, str, str]:
    """Run `cmd`, echoing its output; (exit code, or None when it timed out; its last line, or
    the timeout line; its whole output). A command past `timeout` is killed with its process
    group."""
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                              start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(errors="replace")
        print(out, end="")
        line = f"TIMED OUT after {timeout:g} s: {what} (killed)"
        print(line, flush=True)
        return None, line, out
    print(proc.stdout, end="", flush=True)
    lines = [line.strip("= ") for line in proc.stdout.splitlines() if line.strip()]
    return proc.returncode, lines[-1] if lines else "", proc.stdout


def _pytest(args: list[str], timeout: float, what: str) -> tuple[int | None, str]:
    return run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], timeout, what)[:2]


def _row(code: int | None, summary: str) -> str:
    if code is None:
        return f"FAILED: {summary}"
    return summary if code == 0 else f"FAILED (exit {code}): {summary}"


def gpu_row(nvidia_device: bool, cuda_available: bool) -> tuple[str, bool]:
    """(the GPU row's text, whether the check fails) when torch sees no CUDA device."""
    assert not cuda_available
    if nvidia_device:
        return (f"FAILED: {NVIDIA_DEVICE} exists but torch {torch.__version__} (CUDA build: {torch.version.cuda}) "
                "sees no CUDA device: install a CUDA torch (make gpu-check TORCH_SPEC='torch==2.11.0 --index-url "
                "https://download.pytorch.org/whl/cu128') or use the one already there (PYTHON_ENV=system)"), True
    return "none visible: CUDA tests and benchmarks not run", False


def fast_kernel_missing() -> str | None:
    """Why no fast attention kernel serves the benchmark's bf16, head dim 64 on this GPU (None: one does)."""
    from hf_longctx.ops.backends.select import probe_env, select_backend

    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = select_backend(probe_env(torch.device("cuda")), dtype=torch.bfloat16, head_dim=64, softcap=None)
    if backend.name != "math":
        return None
    return str(caught[-1].message) if caught else "the dispatcher chose the math kernel"


def main(argv: list[str] | None = None, nvidia_device: bool | None = None) -> int:
    """`nvidia_device` overrides the /dev/nvidia0 probe (tests)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--hot-path", action="store_true", help="also run benchmarks/hot_path.py on a GPU machine")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                        help=f"bound of the longest-context probe (default {DEFAULT_MAX_TOKENS})")
    args = parser.parse_args(argv)
    if nvidia_device is None:
        nvidia_device = os.path.exists(NVIDIA_DEVICE)
    cuda = torch.cuda.is_available()
    rows: list[tuple[str, str]] = []
    failed = False

    def step(name: str, result: tuple[int | None, str]) -> None:
        nonlocal failed
        rows.append((name, _row(*result)))
        failed |= result[0] != 0

    step("collect tests/gpu", _pytest(["--collect-only", "tests/gpu"], TIMEOUTS["collect"], "pytest --collect-only tests/gpu"))
    # The multi-GPU tests on their own: exit 5 ("no tests collected") means they went missing.
    step("collect multi-GPU tests (-m multi_gpu)",
         _pytest(["--collect-only", "-m", "multi_gpu", "tests/gpu"], TIMEOUTS["collect"], "collecting the multi-GPU tests"))
    bench = importlib.import_module("benchmarks.gpu_longctx")
    rows.append(("import benchmarks/gpu_longctx.py", "ok"))
    step("emulated backends (tests/unit/test_backends.py)",
         _pytest(["tests/unit/test_backends.py"], TIMEOUTS["emulated"], "tests/unit/test_backends.py"))
    if not cuda or args.hot_path:
        code, last, _ = run([sys.executable, str(HERE / "hot_path.py")], TIMEOUTS["hot_path"], "benchmarks/hot_path.py")
        step("benchmarks/hot_path.py (syncs / ops per layer, emulated)", (code, "ok" if code == 0 else last))
    else:
        rows.append(("benchmarks/hot_path.py", "CPU emulation (CI runs it): --hot-path to run it here"))
    if not cuda:
        text, bad = gpu_row(nvidia_device, False)
        rows.append(("GPU", text))
        failed |= bad
    else:
        n_gpus = torch.cuda.device_count()
        rows.append(("GPU", f"{n_gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"))
        step("CUDA tests, one GPU (tests/gpu, tests/unit/test_offload.py)",
             _pytest(["-rA", "-s", "-m", "not multi_gpu", "tests/gpu", "tests/unit/test_offload.py"],
                     TIMEOUTS["cuda_tests"], "the one-GPU CUDA tests"))
        if n_gpus > 1:  # NCCL, one process per GPU; the 4-GPU cases skip themselves below 4
            step(f"multi-GPU tests, {n_gpus} GPUs (tests/gpu/test_multi_gpu.py)",
                 _pytest(["-rA", "-s", "-m", "multi_gpu", "tests/gpu/test_multi_gpu.py"], TIMEOUTS["multi_gpu"],
                         "the multi-GPU tests"))
        else:
            rows.append(("multi-GPU tests (tests/gpu/test_multi_gpu.py)", "one GPU visible: not run"))
        sync_rows, bad = _sync_step(TIMEOUTS["sync_step"])
        rows += sync_rows
        failed |= bad
        if not args.skip_bench:
            missing = fast_kernel_missing()
            if missing is not None:
                rows.append(("GPU benchmark (benchmarks/gpu_longctx.py)", f"skipped: it would time the math kernel ({missing})"))
            else:
                probe = functools.partial(bench.probe_in_subprocess, timeout=TIMEOUTS["probe"])
                try:
                    rows += bench.run(max_tokens=args.max_tokens, at=min(131072, args.max_tokens), probe=probe)
                except RuntimeError as exc:  # a probe failed (or timed out) for a reason other than an OOM
                    print(exc)
                    rows.append(("GPU benchmark (benchmarks/gpu_longctx.py)", f"FAILED: {str(exc).splitlines()[0]}"))
                    failed = True
    width = max(len(n) for n, _ in rows) + 2
    print("\n" + "=" * (width + 30))
    for name, value in rows:
        print(f"{name:<{width}}{value}")
    print("\n| check | result |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    return 1 if failed else 0


def _sync_step(timeout: float) -> tuple[list[tuple[str, str]], bool]:
    """The rows of benchmarks/gpu_sync_step.py (one per configuration), and whether it failed."""
    from benchmarks.gpu_sync_step import ROW

    code, last, out = run([sys.executable, str(HERE / "gpu_sync_step.py")], timeout,
                          "patched steps under set_sync_debug_mode('error') (benchmarks/gpu_sync_step.py)")
    rows = [tuple(line[len(ROW):].split("\t", 1)) for line in out.splitlines() if line.startswith(ROW)]
    rows = [(f"sync debug 'error': {name}", value) for name, value in rows]
    if code != 0:
        rows.append(("sync debug 'error'", _row(code, last)))
    return rows, code != 0


if __name__ == "__main__":
    sys.exit(main())
