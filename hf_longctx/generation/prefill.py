"""The prefill of a sequence-parallel rollout: the prompts as one packed row, sharded as a training
step, through the patched model once; each rank keeps its shard's K/V; every row's next-token logits.

Where it sits: first step of `generation/loop.sp_generate`. The prompts become documents of one
packed row (positions restart per prompt) and go through `shard_batch` -- the same padding,
permutation and metadata as a training micro-batch, so the attention is USP or FPDT exactly as
in training, under any memory preset -- while `integrations/generation_binding.py` writes every
attention call's local K/V rows into this rank's cache (`ops/decode_cache.py`). Only the rows'
last prompt tokens reach the LM head (`logits_to_keep` with their local indices: no [S_local, V]
logits); each lies on one rank, so one SUM all-reduce over the SP group of [N, V] (zeros but
there) gives every rank every row's logits, exactly (x + 0 = x)."""

from __future__ import annotations

import inspect
from typing import Sequence

import torch
import torch.distributed as dist

from hf_longctx.data.sharding import SP_METADATA_KEY, shard_batch
from hf_longctx.integrations.generation_binding import GenerationBinding
from hf_longctx.model_walk import hf_model
from hf_longctx.ops.decode_cache import DecodeCache, cache_layout


def packed_prompts(prompts: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """The prompts as one packed row: input_ids and per-prompt position_ids [1, ΣP]."""
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long)[None]  # [1, ΣP]
    pos = torch.cat([torch.arange(len(p), dtype=torch.long) for p in prompts])[None]  # [1, ΣP]
    return {"input_ids": ids, "position_ids": pos}


def prefill(model, prompts: Sequence[Sequence[int]], mesh, state, *, max_new_tokens: int, pad_token_id: int,
            device: torch.device, chunk: int, on_host: bool = False) -> tuple[GenerationBinding, torch.Tensor]:
    """Run the prefill with a fresh cache (on the host: `on_host`) bound on `state` (the model's PatchState). Returns the
    binding (left on `state.generation` for the decode steps) and every row's next-token logits
    [N, V] float32, identical on every rank of the SP group."""
    shard = shard_batch(packed_prompts(prompts), mesh, pad_token_id=pad_token_id, device=device)
    cu = shard[SP_METADATA_KEY].cu_seqlens
    local = mesh.local_indices(cu)  # [S_local] global positions this rank holds
    lengths = [len(p) for p in prompts]
    layout = cache_layout(lengths, cu, local, sp=mesh.sp, sp_rank=mesh.sp_rank, max_new_tokens=max_new_tokens)
    binding = GenerationBinding(DecodeCache(layout, device, on_host=on_host), mesh, torch.tensor(lengths, device=device), chunk=chunk)
    where = {g: i for i, g in enumerate(local.tolist())}
    last = [(n, where[cu[n] + lengths[n] - 1]) for n in range(len(prompts)) if cu[n] + lengths[n] - 1 in where]
    keep = torch.tensor([i for _, i in last], dtype=torch.long, device=device)  # local indices of last prompt tokens
    state.generation = binding
    if "logits_to_keep" in inspect.signature(hf_model(model).forward).parameters:
        logits = model(**shard, logits_to_keep=keep).logits[0]  # [k, V]
    else:  # a model without logits_to_keep computes every local row's logits
        logits = model(**shard).logits[0].index_select(0, keep)  # [k, V]
    layers = state.probe.attention_calls if state.probe is not None else len(binding.cache.keys)
    binding.cache.check_prompt(layers)
    rows = torch.zeros(len(prompts), logits.shape[-1], dtype=torch.float32, device=device)  # [N, V]
    if last:
        rows[torch.tensor([n for n, _ in last], device=device)] = logits.float()
    if mesh.sp > 1:
        dist.all_reduce(rows, group=mesh.sp_group)  # [N, V]: each row's logits from the one rank holding its last token
    return binding, rows
