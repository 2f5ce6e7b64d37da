"""`make gpu-check`: validate a GPU machine in one command and print one table.

On CUDA: runs every CUDA-only test (tests/gpu: fast kernels vs the math kernel, the
offload double buffer with real streams; tests/unit/test_offload.py's pinned side-stream
copies; when more than one GPU is visible, the multi-GPU NCCL tests of
tests/gpu/test_multi_gpu.py -- FSDP2 bf16, USP, FPDT, the Trainer, flexible groups -- as
their own row), the
emulated-backend tests, and the GPU benchmark (benchmarks/gpu_longctx.py). On a CPU machine: collects every CUDA-marked test and
imports the GPU benchmark (so a broken import or signature fails here too), runs the
emulated-backend tests, runs benchmarks/hot_path.py when it exists (host syncs and ops per
layer on the emulated CUDA dispatch path), says there is no GPU and exits 0 -- unless an
NVIDIA device node (/dev/nvidia0) exists: then the torch installed is a CPU build (or cannot
see the driver) on a GPU machine, and the check FAILS instead of validating nothing.

Run: python benchmarks/gpu_check.py [--skip-bench] [--max-tokens 262144]
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from pathlib import Path

import torch


def _pytest(*args: str) -> int:
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args])


def _pytest_summary(*args: str) -> tuple[int, str]:
    """Run pytest, echoing its output; (exit code, its last non-empty line: "N passed, M skipped ...")."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(proc.stdout, end="")
    lines = [line.strip("= ") for line in proc.stdout.splitlines() if line.strip()]
    return proc.returncode, lines[-1] if lines else ""


def _row(code: int, summary: str) -> str:
    return summary if code == 0 else f"FAILED (exit {code}): {summary}"


NVIDIA_DEVICE = "/dev/nvidia0"


def gpu_row(nvidia_device: bool, cuda_available: bool) -> tuple[str, bool]:
    """(the GPU row's text, whether the check fails) when torch sees no CUDA device."""
    assert not cuda_available
    if nvidia_device:
        return (f"FAILED: {NVIDIA_DEVICE} exists but torch {torch.__version__} (CUDA build: {torch.version.cuda}) "
                "sees no CUDA device: install a CUDA torch (make gpu-check TORCH_SPEC='torch==2.11.0 --index-url "
                "https://download.pytorch.org/whl/cu128') or use the one already there (PYTHON_ENV=system)"), True
    return "none visible: CUDA tests and benchmarks not run", False


def _script(path: Path, *args: str) -> tuple[str, bool]:
    code = subprocess.call([sys.executable, str(path), *args])
    return ("ok" if code == 0 else f"FAILED (exit {code})"), code != 0


def main(argv: list[str] | None = None, nvidia_device: bool | None = None) -> int:
    """`nvidia_device` overrides the /dev/nvidia0 probe (tests)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=None, help="bound of the longest-context probe (default: gpu_longctx.MAX_TOKENS)")
    args = parser.parse_args(argv)
    if nvidia_device is None:
        nvidia_device = os.path.exists(NVIDIA_DEVICE)
    rows: list[tuple[str, str]] = []
    collect = _pytest("--collect-only", "tests/gpu")
    rows.append(("collect tests/gpu", "ok" if collect == 0 else f"FAILED (exit {collect})"))
    # The multi-GPU tests on their own: exit 5 ("no tests collected") means they went missing.
    collect_multi, summary = _pytest_summary("--collect-only", "-m", "multi_gpu", "tests/gpu")
    rows.append(("collect multi-GPU tests (-m multi_gpu)", _row(collect_multi, summary)))
    bench = importlib.import_module("benchmarks.gpu_longctx")
    rows.append(("import benchmarks/gpu_longctx.py", "ok"))
    emulated = _pytest("tests/unit/test_backends.py")
    rows.append(("emulated backends (tests/unit/test_backends.py)", "ok" if emulated == 0 else f"FAILED (exit {emulated})"))
    failed = collect != 0 or collect_multi != 0 or emulated != 0
    hot_path = Path(__file__).resolve().parent / "hot_path.py"
    if hot_path.exists():
        text, bad = _script(hot_path)
        rows.append(("benchmarks/hot_path.py (syncs / ops per layer)", text))
        failed |= bad
    else:
        rows.append(("benchmarks/hot_path.py", "not present: not run"))
    if not torch.cuda.is_available():
        text, bad = gpu_row(nvidia_device, False)
        rows.append(("GPU", text))
        failed |= bad
    else:
        rows.append(("GPU", f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"))
        gpu, summary = _pytest_summary("-rA", "-s", "-m", "not multi_gpu", "tests/gpu", "tests/unit/test_offload.py")
        rows.append(("CUDA tests, one GPU (tests/gpu, tests/unit/test_offload.py)", _row(gpu, summary)))
        failed |= gpu != 0
        n_gpus = torch.cuda.device_count()
        if n_gpus > 1:  # NCCL, one process per GPU; the 4-GPU cases skip themselves below 4
            multi, summary = _pytest_summary("-rA", "-s", "-m", "multi_gpu", "tests/gpu/test_multi_gpu.py")
            rows.append((f"multi-GPU tests, {n_gpus} GPUs (tests/gpu/test_multi_gpu.py)", _row(multi, summary)))
            failed |= multi != 0
        else:
            rows.append(("multi-GPU tests (tests/gpu/test_multi_gpu.py)", "one GPU visible: not run"))
        if not args.skip_bench:
            try:
                rows += bench.run(max_tokens=args.max_tokens or bench.MAX_TOKENS)
            except RuntimeError as exc:  # a probe failed for a reason other than an OOM
                print(exc)
                rows.append(("GPU benchmark (benchmarks/gpu_longctx.py)", f"FAILED: {str(exc).splitlines()[0]}"))
                failed = True
    width = max(len(n) for n, _ in rows) + 2
    print("\n" + "=" * (width + 30))
    for name, value in rows:
        print(f"{name:<{width}}{value}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
