"""CUDA-only tests (`make gpu-check`): every test here is marked `gpu` and skipped without CUDA,
so a CPU machine still collects (imports) them."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CUDA")
    skip_multi = pytest.mark.skip(reason="needs more than one visible CUDA device")
    for item in items:
        if "tests/gpu/" not in str(item.fspath).replace("\\", "/"):
            continue
        item.add_marker(pytest.mark.gpu)
        if not torch.cuda.is_available():
            item.add_marker(skip)
        elif item.get_closest_marker("multi_gpu") and torch.cuda.device_count() < 2:
            item.add_marker(skip_multi)
