"""Which local attention kernel a patched model's calls ask for: the user's, or the fastest measured.

Where it sits: `integrations/attention.prepare` builds one `AttentionChoice` per call (cached per
device and head dim) and hands it down through `ops/usp.py` / `ops/fpdt.py` to
`ops/kernels.batch_backend`, which `ops/backends/select.py` resolves once per micro-batch.
Guarantees: a backend the user named (`patch(attention_backend=...)`) travels as it is, to be run
or refused with the reason; otherwise the ranking holds only backends measured on this GPU
(`capacity/gpus.py`: kernel microbenchmarks), fastest first at the call's head dim -- a backend
without a measured fraction there is never ranked, so never picked automatically. The GPU is
told by the name CUDA reports (`capacity/gpus.key_of_device`)."""

from __future__ import annotations

import functools

import torch

from hf_longctx import _compat
from hf_longctx.capacity.gpus import GPUS, key_of_device
from hf_longctx.ops.backends import AttentionChoice


def attention_choice(named: str | None, q: torch.Tensor) -> AttentionChoice:
    """The choice of a call with queries like `q` ([..., D] on its device)."""
    return AttentionChoice(named, () if named is not None else measured_ranking(q.device, q.shape[-1]))


@functools.cache
def measured_ranking(device: torch.device, head_dim: int) -> tuple[str, ...]:
    """The backends measured on `device`'s GPU, fastest first; () off CUDA or on a GPU the table lacks."""
    if device.type != "cuda":
        return ()
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = key_of_device(_compat.cuda_device_name(index))
    return GPUS[key].attention_ranking(head_dim) if key is not None else ()
