"""Checkpointing that keeps attention: `patch(..., checkpoint="attention")`.

Where it sits: between the checkpoint wrapper of `integrations/checkpointing.py` (one
`Region` per checkpointed layer call, opened for the forward and again for its recompute)
and the attention function of `integrations/attention.py`, which asks the patch's
`AttentionKeeper` what to do at each call. FPDT §4 / torchtitan's selective checkpointing:
the core attention is most of a long-context layer's FLOPs and owns all its collectives, so
it is the one part NOT recomputed. Its saved tensors and output are kept (on the host where
the device offloads); the recompute replays the kept output (`_Replay`: no kernel, no
collective) and the backward runs through the ORIGINAL graph. Exact: the RNG stream other
ops replay is unchanged. Mechanism and bytes: docs/DESIGN.md "Decisions and why"."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator

import torch

from hf_longctx.ops.offload import Streams, copy_in, copy_out


class _Kept:
    """One host copy of a kept tensor; `uses`: the saved references to it not read back yet."""

    def __init__(self, host: torch.Tensor, device: torch.device) -> None:
        self.host, self.device, self.uses = host, device, 1


def _identity(t: torch.Tensor) -> tuple:
    """What makes two saved tensors the same values: their memory, layout and version."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)


class Region:
    """What one checkpointed layer call keeps of its attention calls (in call order)."""

    def __init__(self, streams: Streams, keeper: "AttentionKeeper") -> None:
        self.streams = streams
        self.keeper = keeper
        self.outputs: list[Any] = []  # each attention call's output (a tensor, or _Kept on the host)
        self.kept: dict[tuple, _Kept] = {}  # every host copy of this region, by the identity of what it copies
        self.back: dict[int, tuple[torch.Tensor, Any]] = {}  # id(_Kept) -> (device copy, event) once prefetched
        self.cursor = 0
        self.recomputing = False
        self.replays = 0

    # ---- keeping (original forward) ----------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> Any:
        """Saved-tensor hook of the attention: keep `tensor` (host copy where the device offloads).
        A tensor saved twice (the attention's output: saved by the attention for its backward
        and kept for the replay) is copied once."""
        streams = self.streams
        if not streams.offloads(tensor.device) or streams.is_host(tensor):
            self.keeper.kept_bytes += tensor.numel() * tensor.element_size()
            return tensor  # CPU, or a host copy already (FPDT's offloaded chunks): kept in place
        key = _identity(tensor)
        kept = self.kept.get(key)
        if kept is not None:
            kept.uses += 1
            return kept
        self.keeper.kept_bytes += tensor.numel() * tensor.element_size()
        (host,), _ = copy_out(streams, [tensor.detach()])  # OUT stream, overlapping the attention's next kernels
        kept = self.kept[key] = _Kept(host, tensor.device)
        return kept

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Kept):
            return packed
        streams = self.streams
        if packed.uses <= 0:
            raise RuntimeError(
                "checkpoint='attention' hands the kept host copies back to the pool when the backward reads them, so "
                "the graph cannot be run backward twice (retain_graph=True); use checkpoint=True or no checkpointing"
            )
        fetched = self.back.get(id(packed))
        if fetched is None:  # not prefetched (no recompute before this read)
            fetched = self.back[id(packed)] = copy_in(streams, [packed.host], packed.device)
        (device_copy,), ready = fetched
        streams.current(packed.device).wait_event(ready)  # the copy back has landed
        packed.uses -= 1
        if packed.uses == 0:  # every saved reference read: the host buffer is free for the next offload
            self.back.pop(id(packed))
            streams.recycle(packed.host)
        return device_copy

    # ---- recompute ---------------------------------------------------------------------------
    def prefetch(self) -> None:
        """Start every host -> device copy of this region on the IN stream (the recompute of
        the layer runs meanwhile on the compute stream)."""
        for kept in self.kept.values():
            if id(kept) not in self.back and kept.uses > 0:
                self.back[id(kept)] = copy_in(self.streams, [kept.host], kept.device)

    def next_output(self) -> torch.Tensor:
        if self.cursor >= len(self.outputs):
            raise RuntimeError(
                f"checkpoint='attention': the recompute made more attention calls ({self.cursor + 1}) than the original "
                f"forward ({len(self.outputs)}); the layer's control flow differs between the two runs"
            )
        out = self.outputs[self.cursor]
        self.cursor += 1
        return self.unpack(out) if isinstance(out, _Kept) else out


class _Replay(torch.autograd.Function):
    """The attention's output in the recompute: the kept value, attached to the recomputed
    q, k, v so that the ops after it record the same graph (and save the same tensors) as in
    the original forward. The recompute's graph is never differentiated."""

    @staticmethod
    def forward(ctx, query, key, value, holder):
        return holder[0].detach()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("checkpoint='attention': the replayed attention output was differentiated; gradients must "
                           "flow through the original forward's graph (non-reentrant checkpoint)")


class AttentionKeeper:
    """Per patch: which layer region the attention calls belong to, and what they do there."""

    def __init__(self, streams: Streams) -> None:
        self.streams = streams
        self.region: Region | None = None
        self.replayed = 0  # attention calls answered from kept outputs (tests and benchmarks count them)
        self.kept_bytes = 0  # bytes kept so far (saved tensors + outputs; benchmarks/recompute.py reads it)

    def new_region(self) -> Region:
        return Region(self.streams, self)

    @contextmanager
    def entered(self, region: Region, recompute: bool) -> Iterator[None]:
        """Around one run of a checkpointed layer: its original forward, or its recompute."""
        if recompute:
            region.cursor, region.recomputing = 0, True
            region.prefetch()
        previous, self.region = self.region, region
        try:
            yield
        finally:
            self.region = previous

    # ---- the attention's side (integrations/attention_route.AttentionRoute) ---------------------
    def answer(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
        """In a recompute, the kept output of this call (no kernel, no collective); else None."""
        return self.replay(query, key, value) if self.replaying() else None

    def run(self, attend: Callable[[bool], torch.Tensor], prepared: Callable[[], tuple]) -> torch.Tensor:
        """The original forward's attention with its saved tensors and output kept."""
        with self.keeping():  # saved tensors escape the checkpoint
            out = attend(True)
        self.keep(out)
        return out

    def replaying(self) -> bool:
        return self.region is not None and self.region.recomputing

    def replay(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        self.replayed += 1
        return _Replay.apply(query, key, value, (self.region.next_output(),))

    def keeping(self):
        """Around the attention of the original forward: its saved tensors escape the checkpoint."""
        region = self.region
        if region is None:
            return nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(region.pack, region.unpack)

    def keep(self, out: torch.Tensor) -> None:
        if self.region is not None:
            self.region.outputs.append(self.region.pack(out.detach()))
