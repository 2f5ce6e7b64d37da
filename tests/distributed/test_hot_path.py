"""No host sync inside a decoder layer on the CUDA dispatch path, and a counter that sees one.

`benchmarks/hot_path.py` counts, with `benchmarks/_counting.py`, what would block the host on
CUDA while a patched tiny model runs one fwd+bwd step with the local attention forced onto
the packed flash-attn backend (emulated kernel), every offload on its CUDA branch (stub
streams) and every CPU-side tensor treated as host unless it is the device copy. Per layer
= the difference between a 4-layer and a 2-layer model. Every attention layout, memory
preset and linear-mixer kind (conv, Gated DeltaNet, Mamba-2, RG-LRU) must show 0 syncs per
layer.

A zero is only worth something if the counter sees a sync where there is one: each kind
of sync is inserted into the real patched step (a value read, `nonzero`, a pageable
upload, `.tolist()` and `.cpu()` in the backward, a blocking device->host `copy_`, a
host-built index cached by the mixers and read on the device) and must be counted per layer.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from benchmarks.hot_path import LAYOUTS, layout_costs
from tests.helpers.pool import worker_mesh


def _costs(label: str, ulysses: int, ring: int, chunks: int, fault: str | None = None) -> dict:
    with _fault(fault):
        return layout_costs(label, worker_mesh(ulysses, ring, chunks), baseline=False)


@pytest.mark.parametrize("label,ulysses,ring,chunks", [row[:4] for row in LAYOUTS], ids=[row[0] for row in LAYOUTS])
def test_no_sync_per_layer(pools, label, ulysses, ring, chunks):
    for rank, c in enumerate(pools.get(ulysses * ring).run(_costs, label, ulysses, ring, chunks)):
        assert c["syncs"] == 0, f"{label}, rank {rank}: {c['syncs']} syncs per layer at {c['sync_sites']}"
        assert c["kernels"] > 0 and c["collectives"] > 0  # the counter sees the layer's work
        if "offload" in label or "high" in label or "max" in label:  # the CUDA offload branch ran
            assert c["h2d"] > 0 and c["d2h"] > 0, c


def _forward_fault(fault: str):
    def inserted(q, k, v, *args, **kwargs):
        if fault == "item":
            q.float().sum().item()
        elif fault == "nonzero":
            (q > 0).nonzero()
        elif fault == "pageable upload":
            torch.arange(3).to(q.device)
        elif fault == "blocking copy_ to host":
            torch.empty(q.shape, dtype=q.dtype).copy_(q)
    return inserted


def _backward_fault(fault: str):
    def inserted(dout, q, *args, **kwargs):
        if fault == "tolist in backward":
            dout.tolist()
        elif fault == "cpu in backward":
            q.cpu()
    return inserted


@contextlib.contextmanager
def _fault(fault: str | None):
    if fault is None:
        yield
        return
    from hf_longctx.ops import kernels
    from hf_longctx.ops.mixers.layout import SequenceLayout

    saved = kernels.varlen_forward, kernels.varlen_backward, SequenceLayout.on_device
    fwd, bwd, before_fwd, before_bwd = saved[0], saved[1], _forward_fault(fault), _backward_fault(fault)

    def varlen_forward(*args, **kwargs):
        before_fwd(*args, **kwargs)
        return fwd(*args, **kwargs)

    def varlen_backward(*args, **kwargs):
        before_bwd(*args, **kwargs)
        return bwd(*args, **kwargs)

    kernels.varlen_forward, kernels.varlen_backward = varlen_forward, varlen_backward
    if fault == "host index cached by the mixers":
        SequenceLayout.on_device = lambda self, key, device, build: self._device.setdefault((key, "host"), build())
    try:
        yield
    finally:
        kernels.varlen_forward, kernels.varlen_backward, SequenceLayout.on_device = saved


FAULTS = {  # fault -> (layout, what the counter must report)
    "item": ("U2", "aten._local_scalar_dense"),
    "nonzero": ("R2", "aten.nonzero"),
    "pageable upload": ("U2", "blocking host->device .to()"),
    "blocking copy_ to host": ("R2", "blocking device->host copy_"),
    "tolist in backward": ("U2", "Tensor.tolist() of a device tensor"),
    "cpu in backward": ("R2", "blocking device->host .cpu()"),
    "host index cached by the mixers": ("conv: LFM2 (U2)", "reads a host tensor"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_an_inserted_sync_is_counted_per_layer(pools, fault):
    label, site = FAULTS[fault]
    _, ulysses, ring, chunks, _, _ = next(row for row in LAYOUTS if row[0] == label)
    c = pools.get(ulysses * ring).run(_costs, label, ulysses, ring, chunks, fault)[0]
    assert c["syncs"] >= 1, f"{fault} inserted into {label} went uncounted: {c}"
    assert any(site in s for s in c["sync_sites"]), (fault, c["sync_sites"])
