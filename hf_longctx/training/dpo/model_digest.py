"""A 64-bit identity of a model's weights, cheap enough to read at every trainer construction.

Where it sits: `LongDPOTrainer.__init__` digests the reference (the explicit `ref_model`, or the
initial policy for TRL's default) before anything is sharded, when every rank holds the same
full weights; the digest is stored beside precomputed reference columns (`ref_model_hash`) and
compared with the reference of a trainer that reuses them (`dpo/ref_fingerprint.py`).
Guarantees: deterministic across processes and devices, and equal for the same weights loaded
in fp32 or bf16 (every value is read rounded to bf16); it reads each parameter's shape and an
evenly strided sample of at most `SAMPLE` of its values, so its cost is independent of the
model's size. Two checkpoints that differ only in weights left out of every sample, or below
bf16 precision, share a digest: rescoring (`verify_ref_logps`) is the check that reads values.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

SAMPLE = 64  # values read per parameter tensor: a few thousand for an 8B model


def _values(p: torch.Tensor) -> np.ndarray:
    """An evenly strided sample of `p`'s values, rounded to bf16, as float32 (empty when the
    values are not readable here without a collective: a sharded DTensor, the meta device)."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor) or p.is_meta or p.numel() == 0:
        return np.zeros(0, dtype=np.float32)
    flat = p.detach().reshape(-1)  # [numel]
    step = max(1, flat.numel() // SAMPLE)
    # bf16 first: fp32 weights and the same weights loaded in bf16 read alike (round to nearest even).
    return flat[::step][:SAMPLE].to(torch.bfloat16).float().cpu().numpy()


def model_digest(model: Any) -> int:
    """The signed 64-bit digest of `model`'s parameters, in registration order (wrappers added by
    `patch` keep it): each one's shape and bf16-rounded sample."""
    h = hashlib.blake2b(digest_size=8)
    for p in model.parameters():
        h.update(np.asarray([p.dim(), *p.shape], dtype=np.int64).tobytes())
        h.update(_values(p).tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)
