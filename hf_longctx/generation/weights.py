"""Where a rollout's weights live: gathered once per rollout, or left to FSDP2's per-unit gathers.

Where it sits: around `generation/loop.sp_generate` (and the per-rank path's
`training/grpo/generate.unpatched_for_generation`, which gathers the same way). Two choices:
- "gathered": every FSDP2 unit is all-gathered ONCE (the same calls in the same order on every
  rank) and kept unsharded for the rollout; the forwards inside make no FSDP collective, so only
  the SP group's own collectives run per step. Costs the unsharded model in the compute dtype.
- "sharded": the weights stay as in training; each forward (the prefill and every decode step)
  all-gathers each unit when it runs and frees it after. Costs FSDP's working set only, but the
  whole model's bytes cross the links per decode step, and since the all-gathers span the world,
  every DP group must run the same number of forwards (the loop agrees on it every step).
"auto" takes "gathered" where the unsharded weights and the cache fit in the device's free
memory on every rank (one MIN all-reduce over the world, so all ranks choose alike), else
"sharded". A model without FSDP2 units ("local": replicated or one process) gathers nothing.
The cache's place is chosen with them: on the device where it fits, else in pinned host memory
(`ops/decode_cache.DecodeCache(on_host=True)`: read over PCIe every decode step)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

from hf_longctx._compat import fsdp_param_groups
from hf_longctx.errors import NotSupported
from hf_longctx.flex.unsharded_step import fsdp_units, unsharded_bytes

MODES = ("auto", "gathered", "sharded")
CACHES = ("auto", "device", "host")
HEADROOM = 1.1  # the allocator's fragmentation and the prefill's working set beside the cache


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def choose(model: torch.nn.Module, mesh, mode: str, cache_bytes: int, cache: str = "device") -> tuple[str, str, str]:
    """(weights, cache, why): weights "local", "gathered" or "sharded" and the cache "device" or "host",
    the same on every rank of the world. "auto" (either): the weights gathered where they fit beside
    the cache in the device's free memory on every rank, else sharded; the cache on the device where
    it fits there, else on the host. On a CPU device everything "fits" (host memory)."""
    if mode not in MODES:
        raise ValueError(f"weights must be one of {MODES}, got {mode!r}")
    if cache not in CACHES:
        raise ValueError(f"cache must be one of {CACHES}, got {cache!r}")
    units = fsdp_units(model)
    need = unsharded_bytes(model, gradients=False) if units else 0
    device = next(model.parameters()).device
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    # What fits, on every rank (1 = fits): [the whole model and the cache, the cache alone, the whole model alone].
    fits = torch.tensor([1.0, 1.0, 1.0], device=device)
    if free is not None:
        fits = torch.tensor([float(HEADROOM * b <= free) for b in (need + cache_bytes, cache_bytes, need)], device=device)
    if mesh.world_size > 1 and "auto" in (mode, cache):
        dist.all_reduce(fits, op=dist.ReduceOp.MIN, group=mesh.world_mesh.get_group())  # [3]: on every rank
    both, alone, model_only = (bool(x) for x in fits.tolist())
    place = cache if cache != "auto" else "device" if alone else "host"
    whole = both if place == "device" else model_only
    where = "host memory" if free is None else f"{_size(free)} free on this device"
    if not units:
        weights, why = "local", "the model is not FSDP2-sharded: every rank holds its weights"
    elif mode != "auto":
        weights, why = mode, f"weights={mode!r} was asked for (the whole model is {_size(need)} unsharded)"
    elif whole:
        weights, why = "gathered", f"the whole model ({_size(need)}) and the cache fit beside the shards ({where})"
    else:
        weights, why = "sharded", (f"the whole model ({_size(need)}) and the cache ({_size(cache_bytes)}) do not fit "
                                   "on every rank: FSDP2 gathers one unit at a time")
    return weights, place, why + (f"; the cache on the {'device' if place == 'device' else 'host (pinned, read per step)'}")


@contextmanager
def gathered(model: torch.nn.Module) -> Iterator[None]:
    """Inside: every FSDP2 unit of `model` is unsharded and stays so across forwards (no FSDP
    collective in them). One all-gather per unit on entry, in module order on every rank; on exit
    each unit's reshard-after-forward setting is restored and its gathered parameters freed (local)."""
    units = fsdp_units(model)
    # post_forward_mesh_info is what set_reshard_after_forward writes (torch has no getter): saved to restore it.
    saved = [[g.post_forward_mesh_info for g in fsdp_param_groups(u)] for u in units]
    with torch.no_grad():
        for u in units:
            u.unshard()  # all-gather this unit's parameters: one collective per unit, in module order on every rank
        for u in units:
            u.set_reshard_after_forward(False, recurse=False)  # forwards inside neither gather nor free
    try:
        yield
    finally:
        for u, infos in zip(units, saved):
            for g, info in zip(fsdp_param_groups(u), infos):
                g.post_forward_mesh_info = info
            u.reshard()  # free the gathered parameters; local, no collective


@contextmanager
def rollout_weights(model: torch.nn.Module, mode: str) -> Iterator[str]:
    """The weights as `mode` (from `choose`) places them for the rollout; yields the mode."""
    if mode == "gathered":
        with gathered(model):
            yield mode
    elif mode in ("sharded", "local"):
        yield mode
    else:
        raise NotSupported(f"unknown weights mode {mode!r}", f"one of {MODES}")
