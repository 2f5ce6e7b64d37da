"""What a sequence-parallel rollout refuses, checked on every rank before any collective.

Where it sits: the first thing `generation/loop.sp_generate` does. Every rank of an SP group is
given the same rows (the group decodes them together), so every check below raises the same
error on every rank, naming the offending values and the fix, and no rank is left waiting in a
collective. The one check that needs a collective -- that the group's ranks really were given
the same rows and settings -- is `same_rows_everywhere`: one all-gather of a fingerprint over
the SP group, after which all ranks raise together."""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import torch
import torch.distributed as dist

from hf_longctx.data.token_ids import Vocabulary, check_token_ids
from hf_longctx.errors import NotSupported
from hf_longctx.generation.settings import SamplingSettings
from hf_longctx.integrations.model_patch import patch_state
from hf_longctx.model_walk import hf_model

PER_RANK = "generate on the per-rank path (generation='per-rank': transformers' own generate on gathered weights)"


def check_model(model: Any, mesh) -> Any:
    """The model's PatchState, after refusing what the sequence-parallel decode cannot run."""
    from hf_longctx.distributed.mesh import SPMesh

    state = patch_state(model)
    if state is None:
        raise NotSupported("sp_generate needs a model patched for sequence parallelism",
                           "hf_longctx.patch(model, mesh) first, or call model.generate on the unpatched model")
    if not isinstance(mesh, SPMesh) or not isinstance(state.bank, SPMesh):
        raise NotSupported("sp_generate runs on one fixed SP mesh; a GroupBank (flexible SP groups) is not supported",
                           "patch the model with init_sequence_parallel(...)'s mesh for generation")
    if mesh != state.mesh:
        raise ValueError(f"sp_generate got mesh {mesh} but the model is patched with {state.mesh}; pass that mesh")
    if state.mixers is not None:
        raise NotSupported(
            "the model has linear mixers (a hybrid): their recurrent state per row would have to be carried from the "
            "prefill through every decode step under SP (state passing), which sp_generate does not implement",
            PER_RANK)
    if state.vision is not None:
        raise NotSupported("sp_generate decodes text-only models; this one has a vision tower", PER_RANK)
    return state


def check_rows(model: Any, prompts: Sequence[Sequence[int]], owners: Sequence[int], mesh,
               settings: SamplingSettings, max_tokens: int | None) -> None:
    """The rows: non-empty token lists within the vocabulary, owners SP ranks, the rollout within
    `max_tokens` (prompt + completion tokens of all rows) and the model's position limit."""
    if not prompts:
        raise ValueError("sp_generate needs at least one prompt")
    empty = [i for i, p in enumerate(prompts) if len(p) == 0]
    if empty:
        raise ValueError(f"prompts {empty[:8]} are empty; every row needs at least one prompt token")
    if len(owners) != len(prompts) or any(not 0 <= o < mesh.sp for o in owners):
        raise ValueError(f"owners must give an SP rank in [0, {mesh.sp}) for each of the {len(prompts)} rows, got "
                         f"{list(owners)[:8]}")
    hf = hf_model(model)
    emb = hf.get_input_embeddings()
    vocab = Vocabulary(int(emb.weight.shape[0]), int(getattr(hf.config.get_text_config(), "vocab_size", emb.weight.shape[0])))
    for i, p in enumerate(prompts):
        check_token_ids(torch.as_tensor(list(p), dtype=torch.long), None, vocab, f"prompt {i}")
    longest = max(len(p) for p in prompts) + settings.max_new_tokens
    limit = getattr(hf.config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and longest > limit:
        raise ValueError(f"a prompt of {longest - settings.max_new_tokens} tokens + max_new_tokens "
                         f"{settings.max_new_tokens} = {longest} exceeds the model's max_position_embeddings {limit}; "
                         "shorten the prompt or max_new_tokens")
    total = sum(len(p) for p in prompts) + len(prompts) * settings.max_new_tokens
    if max_tokens is not None and total > max_tokens:
        raise ValueError(f"the rollout's {len(prompts)} rows hold {sum(len(p) for p in prompts)} prompt tokens + "
                         f"{len(prompts)} x max_new_tokens {settings.max_new_tokens} = {total} tokens, over "
                         f"max_tokens {max_tokens} (the SP group's planned rollout size); pass fewer or shorter "
                         "prompts, a smaller max_new_tokens, or plan a larger max_tokens")


def same_rows_everywhere(prompts: Sequence[Sequence[int]], owners: Sequence[int], settings: SamplingSettings,
                         mesh, device: torch.device) -> None:
    """ValueError on every rank of the SP group unless all its ranks hold the same rows, owners and
    settings (one all-gather of an int64 fingerprint)."""
    if mesh.sp == 1:
        return
    text = repr((tuple(tuple(int(t) for t in p) for p in prompts), tuple(owners), settings))
    value = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big")  # the same in every process
    mine = torch.tensor([value], dtype=torch.long, device=device)
    parts = [torch.empty_like(mine) for _ in range(mesh.sp)]
    dist.all_gather(parts, mine, group=mesh.sp_group)  # [SP] x [1]
    seen = [int(p.item()) for p in parts]
    if len(set(seen)) > 1:
        raise ValueError(
            f"the ranks of one SP group passed different rows or settings to sp_generate (per-rank fingerprints {seen}); "
            "every rank of an SP group must pass the same prompts, owners and sampling options -- draw the prompts by "
            "DP rank, not by global rank")
