"""`make gpu-check`: validate a GPU machine in one command and print one table.

On CUDA: runs every CUDA-only test (tests/gpu: fast kernels vs the math kernel, the
offload double buffer with real streams, FSDP2 bf16 on one GPU; multi-GPU tests when more
than one GPU is visible), the emulated-backend tests, and the GPU benchmark
(benchmarks/gpu_longctx.py). On a CPU machine: collects every CUDA-marked test and
imports the GPU benchmark (so a broken import or signature fails here too), runs the
emulated-backend tests, says there is no GPU and exits 0.

Run: python benchmarks/gpu_check.py [--skip-bench]
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import torch


def _pytest(*args: str) -> int:
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-bench", action="store_true")
    args = parser.parse_args()
    rows: list[tuple[str, str]] = []
    collect = _pytest("--collect-only", "tests/gpu")
    rows.append(("collect tests/gpu", "ok" if collect == 0 else f"FAILED (exit {collect})"))
    bench = importlib.import_module("benchmarks.gpu_longctx")
    rows.append(("import benchmarks/gpu_longctx.py", "ok"))
    emulated = _pytest("tests/unit/test_backends.py")
    rows.append(("emulated backends (tests/unit/test_backends.py)", "ok" if emulated == 0 else f"FAILED (exit {emulated})"))
    failed = collect != 0 or emulated != 0
    if not torch.cuda.is_available():
        rows.append(("GPU", "none visible: CUDA tests and benchmarks not run"))
    else:
        rows.append(("GPU", f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"))
        gpu = _pytest("-rA", "-s", "tests/gpu")
        rows.append(("CUDA tests (tests/gpu)", "ok" if gpu == 0 else f"FAILED (exit {gpu})"))
        failed |= gpu != 0
        if not args.skip_bench:
            rows += bench.run()
    width = max(len(n) for n, _ in rows) + 2
    print("\n" + "=" * (width + 30))
    for name, value in rows:
        print(f"{name:<{width}}{value}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
