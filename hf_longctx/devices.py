"""Host-to-device copies that do not block the host.

Where it sits: the lowest floor (torch only), so that the data floor (`data/sharding.py`
moves each rank's shard to its device), the kernels (`ops/backends/packed.py` uploads its
block index once per micro-batch) and `patch()`'s consistency check share one rule for
moving a host-built tensor: no host sync inside a layer (issue 19, DESIGN "Devices and
kernels").
"""

from __future__ import annotations

import torch


def upload(host: torch.Tensor, device) -> torch.Tensor:
    """A host-built tensor on `device` without blocking the host: on CUDA staged in pinned
    memory (torch's caching host allocator keeps the block until the copy has run) and
    copied with non_blocking=True; a no-op on CPU."""
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
