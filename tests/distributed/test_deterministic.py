"""Deterministic mode: `torch.use_deterministic_algorithms(True)` gives bit-identical gradients
run to run on every layout, and the kernels are told.

Each layout of `benchmarks/hot_path.py` (Ulysses, ring, U x R, FPDT, the memory presets,
every linear-mixer kind) runs one patched bf16 step twice from the same weights, with the
local attention on the packed CUDA backend whose kernel is the emulation of
`tests/helpers/emulated_backends.py` (flash-attn 2.8's real signature, or torch's flash ops). The
emulated backward is what the real ones are: run-to-run different in dq unless it is
deterministic (flash-attn's `deterministic` argument; torch's op reads the global flag).
So the comparison fails if any path forgets to ask -- the control below shows that it
can: with the mode off the two runs differ.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from benchmarks.hot_path import LAYOUTS
from tests.helpers.pool import worker_mesh


@contextlib.contextmanager
def _emulated(kernel: str):
    from hf_longctx.ops import kernels
    from hf_longctx.ops.backends.packed import PackedBackend
    from tests.helpers.emulated_backends import cuda_env

    env, sims = cuda_env(flash="2.8.3", torch_ops=True)
    backend = PackedBackend(kernel, env.flash_attn if kernel == "flash_attn" else env.torch_flash)
    old = kernels.backend_for
    kernels.backend_for = lambda q, *, softcap, mask=False, **_: backend
    try:
        yield sims[kernel]
    finally:
        kernels.backend_for = old


def _two_runs(label: str, kernel: str, deterministic: bool) -> tuple[bool, list[bool]]:
    """(gradients bit-identical across the two runs, what the kernel was told per backward call)."""
    from benchmarks.hot_path import _batch, _model
    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.integrations.model_patch import patch

    _, ulysses, ring, chunks, options, family = next(row for row in LAYOUTS if row[0] == label)
    mesh = worker_mesh(ulysses, ring, chunks)
    runs, told = [], []
    torch.use_deterministic_algorithms(deterministic)
    try:
        for _ in range(2):
            model = _model(family, 2)
            patch(model, mesh, **options)
            model.train()
            with _emulated(kernel) as sim:
                model(**shard_batch(_batch(), mesh)).loss.backward()
            told += sim.deterministic
            runs.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    finally:
        torch.use_deterministic_algorithms(False)
    same = runs[0].keys() == runs[1].keys() and all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])
    return same, told


@pytest.mark.parametrize("label,ulysses,ring", [row[:3] for row in LAYOUTS], ids=[row[0] for row in LAYOUTS])
def test_bit_identical_gradients_run_to_run(pools, label, ulysses, ring):
    for rank, (same, told) in enumerate(pools.get(ulysses * ring).run(_two_runs, label, "flash_attn", True)):
        assert told and all(told), f"{label}, rank {rank}: flash-attn's backward was not asked to be deterministic: {told}"
        assert same, f"{label}, rank {rank}: gradients differ between two deterministic runs"


def test_torch_flash_kernels_follow_the_global_flag(pools):
    for same, told in pools.get(4).run(_two_runs, "U2xR2", "torch_flash", True):
        assert told and all(told) and same


def test_without_deterministic_mode_the_runs_differ(pools):
    """The control: the comparison above sees a non-deterministic kernel."""
    results = pools.get(4).run(_two_runs, "U2xR2", "flash_attn", False)
    assert all(not any(told) for _, told in results)
    assert not all(same for same, _ in results)
