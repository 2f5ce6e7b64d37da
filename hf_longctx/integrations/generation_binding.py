"""What the patched attention does while `hf_longctx.generation` runs a rollout: capture the
prefill's K/V into the sharded cache, then answer every decode step's attention from it.

Where it sits: bound on the patch's state (`PatchState.generation`) by `generation/loop.py` for
one rollout, read by the registered attention (`integrations/attention.py`) and the forward
hooks. Prefill: the forward is a training-like sharded forward (`shard_batch`'s layout, USP or
FPDT attention, any memory preset); every attention call's local K/V rows (after RoPE, in the
compute dtype, the rows of a memory="max" row chunk included) go to this rank's cache
(`ops/decode_cache.py`: its own tokens, all KV heads). Decode: the forward runs every row's new
token (the same tokens on every rank, so the token-wise layers give the same hidden states
everywhere); each attention call appends the new K/V of the rows this rank owns, computes its
split-KV partial (`ops/decode_attention.py`) and merges the group's partials
(`ops/decode_merge.py`: one all-gather per layer). The key-visibility masks are the step's, not
the layer's: built at the step's first call of each window (layers may differ in window: Gemma 2
alternates sliding and global) and read by every later layer of that window in the step. A
"dummy" step (this DP group finished while another still decodes and FSDP2 gathers per forward)
returns zeros: no cache write, no collective, for every rank of the group alike. Design:
docs/DESIGN.md "Generation is sequence-parallel too"."""

from __future__ import annotations

import torch

from hf_longctx.ops.decode_attention import DEFAULT_CHUNK, decode_partial, visibility_masks
from hf_longctx.ops.decode_cache import DecodeCache
from hf_longctx.ops.decode_merge import merge_partials


class GenerationBinding:
    """The rollout's cache and step, as the attention reads them. `decoding` False: the prefill
    (capture); True: decode steps (`begin_step` sets each step's positions)."""

    def __init__(self, cache: DecodeCache, mesh, prompt_lengths: torch.Tensor, chunk: int = DEFAULT_CHUNK) -> None:
        self.cache, self.mesh, self.chunk = cache, mesh, chunk
        self.prompt_lengths = prompt_lengths  # [N] long, on the cache's device
        self.decoding = False
        self.dummy = False
        self.step = -1
        self.query_pos: torch.Tensor | None = None  # [N]: P_n + step
        # window -> this step's `visibility_masks` (cleared per step). The valid count needs no key:
        # `cache.append` returns step_base[step + 1], one layout for every layer.
        self.masks: dict[int | None, list[torch.Tensor]] = {}

    def capture(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Prefill: `layer`'s next local K/V rows [1, S_rows, H_kv, D] into the cache."""
        if k.shape[0] != 1:
            raise ValueError(f"the prefill runs one packed row, got B = {k.shape[0]}")
        self.cache.write_prompt(layer, k[0], v[0])

    def begin_step(self, step: int, dummy: bool = False) -> None:
        """Decode `step` (feeding completion token `step` of every row) begins; `dummy`: a forward
        kept only so that every DP group runs the same number of forwards."""
        self.decoding, self.step, self.dummy = True, step, dummy
        self.query_pos = self.prompt_lengths + step  # [N]: every row's new token sits right after its last one
        self.masks = {}  # the last step's masks saw other query positions and fewer slots

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
               window: int | None, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
        """One decode attention call: q [1, N, H, D], k/v [1, N, H_kv, D] (the new tokens, after RoPE,
        in the compute dtype) -> [1, N, H, D] in q's dtype, the attention over every row's cache."""
        if self.dummy:
            return torch.zeros_like(q)  # every rank of this SP group is in the same dummy step: no collective
        if layer not in self.cache.keys:
            raise RuntimeError(f"decode attention call {layer} has no prefill cache ({len(self.cache.keys)} layers "
                               "captured): the model takes another path in decode than in its prefill")
        filled = self.cache.append(layer, self.step, k[0], v[0])
        masks = self.masks.get(window)
        if masks is None:  # the step's first layer of this window
            masks = self.masks[window] = visibility_masks(self.cache.slot_rows, self.cache.slot_pos, self.query_pos,
                                                          filled, window, self.chunk)  # [C] bool per chunk
        out, lse = decode_partial(q[0], self.cache.keys[layer], self.cache.values[layer], self.cache.slot_rows,
                                  self.cache.slot_pos, self.query_pos, filled, scale=scale, window=window,
                                  softcap=softcap, chunk=self.chunk, masks=masks)  # [N, H, D], [N, H] fp32
        out = merge_partials(out, lse, group=self.mesh.sp_group, size=self.mesh.sp, sinks=sinks)  # [N, H, D]
        return out.to(q.dtype, memory_format=torch.contiguous_format).unsqueeze(0)  # [1, N, H, D]: rounded once
