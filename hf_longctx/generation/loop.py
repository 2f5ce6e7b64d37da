"""`sp_generate`: completions of a patched model on the training mesh, the KV cache sharded over the
SP group like a training step's sequence.

Where it sits: the rollouts of `LongGRPOTrainer`, `LongRLOOTrainer` and `grpo_step`, and a public
entry point. Data flow: checks (`generation/checks.py`, before any collective) -> the weights'
place for the rollout (`generation/weights.py`: gathered once, or FSDP2's per-unit gathers) ->
prefill (`generation/prefill.py`: the prompts packed and sharded as a training micro-batch, each
rank keeping its shard's K/V) -> decode steps: every row's last token through the model, each
attention layer merging the ranks' split-KV partials (`integrations/generation_binding.py`) ->
sampling by each row's owner rank as `generate` samples (`generation/sampler.py`), the tokens
shared over the SP group. Per decode step: the layers' all-gathers of partials (one per attention
layer), one all-gather of tokens, one host read, and -- with "sharded" weights only -- FSDP2's
all-gathers and one MAX all-reduce over the world that keeps every DP group stepping while any
still decodes (a finished group runs "dummy" forwards: no cache write, no SP collective). So no
collective depends on what one rank alone knows. Design: docs/DESIGN.md "Generation is
sequence-parallel too" (flash-decoding split-KV; decode context parallelism)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from hf_longctx.capacity.generation_budget import cache_bytes_per_token
from hf_longctx.data.model_dims import ModelDims
from hf_longctx.generation.checks import check_model, check_rows, same_rows_everywhere
from hf_longctx.generation.prefill import prefill
from hf_longctx.generation.sampler import OwnerSampler, share_tokens, token_order
from hf_longctx.generation.settings import SamplingSettings, sampling_settings
from hf_longctx.generation.weights import choose, rollout_weights
from hf_longctx.ops.decode_attention import DEFAULT_CHUNK


def cache_bytes_estimate(model, prompts: Sequence[Sequence[int]], settings: SamplingSettings, mesh) -> int:
    """This rank's cache bytes: the rows' prompt + completion tokens over the SP group, at the
    planner's bytes per cached token (`capacity/generation_budget.cache_bytes_per_token`) in the
    model's dtype (the `weights="auto"` choice)."""
    dt = next(model.parameters()).element_size()
    tokens = sum(len(p) for p in prompts) + len(prompts) * settings.max_new_tokens
    return int(tokens / mesh.sp * cache_bytes_per_token(ModelDims.from_config(model.config), dt))


def sp_generate(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], mesh, settings: SamplingSettings | None = None, *,
    owners: Sequence[int] | None = None, weights: str = "auto", cache: str = "auto", max_tokens: int | None = None,
    log: Callable[[str], Any] | None = print, chunk: int = DEFAULT_CHUNK, **sampling: Any,
) -> list[list[int]]:
    """Completions of `prompts` by a model patched with `mesh`, generated sequence-parallel: each
    rank holds the K/V of its shard of every row and decodes with the others. Call it on every rank
    of the world when the model is FSDP2-sharded (its all-gathers span the world).

    Args:
        model: The model, patched with `mesh`.
        prompts: Token lists, the same list on every rank of the SP group.
        mesh (SPMesh): This rank's mesh.
        settings: `sampling_settings(...)`; or give `generate`-style keywords in `sampling`.
        owners: `owners[n]`: the SP rank whose global RNG samples row n (default: SP rank 0 samples
            all), exactly as `generate` samples the batch of that rank's rows.
        weights: "auto" (gathered once when the whole model and the cache fit the device, else
            FSDP2's per-unit gathers), "gathered" or "sharded".
        cache: "auto" (the device where it fits there on every rank, else the host), "device" or
            "host" (pinned host memory, each decode step reading it over PCIe chunk by chunk:
            caches beyond the device, at the host link's speed).
        max_tokens: The prompt + completion tokens the rollout was planned for (`hf-longctx plan
            --rollout-tokens`); more is refused before generation.
        log: Gets one line on global rank 0 naming the choices and why (default print; None: silent).
        chunk: Key slots per chunk of the decode attention (`ops/decode_attention.py`; each
            chunk's partial merged by log-sum-exp).
        **sampling: max_new_tokens, do_sample, temperature, top_k, top_p, min_p,
            repetition_penalty, eos_token_id, pad_token_id -- resolved over the model's
            generation_config and transformers' defaults as `generate` resolves them.

    Returns:
        Each row's completion tokens, up to and including the first stop token (max_new_tokens
            of them if none), identical on every rank of the group.

    Raises:
        ValueError: `settings` and keywords together, bad values, rows that differ over the group.
        NotSupported: A sampling option it does not apply, named (before any collective).
    """
    state = check_model(model, mesh)
    if settings is not None and sampling:
        raise ValueError(f"pass either settings= or sampling keywords, not both (got {sorted(sampling)})")
    settings = settings if settings is not None else sampling_settings(model=model, **sampling)
    owners = list(owners) if owners is not None else [0] * len(prompts)
    check_rows(model, prompts, owners, mesh, settings, max_tokens)
    device = next(model.parameters()).device
    same_rows_everywhere(prompts, owners, settings, mesh, device)
    mode, place, why = choose(model, mesh, weights, cache_bytes_estimate(model, prompts, settings, mesh), cache)
    if log is not None and mesh.rank == 0:
        log(f"sp_generate: weights {mode} -- {why}; K/V cache sharded over {mesh.sp} SP rank(s), "
            f"{len(prompts)} rows, up to {settings.max_new_tokens} new tokens each")
    if place == "host":  # the step's free pinned buffers make room for the cache; the step pins them again
        from hf_longctx.ops.offload import release_pinned

        release_pinned()
    was_training = model.training
    model.eval()
    try:
        with rollout_weights(model, mode), torch.no_grad():
            return _decode(model, prompts, owners, mesh, state, settings, device, chunk, lockstep=mode == "sharded",
                           on_host=place == "host")
    finally:
        state.generation = None
        model.train(was_training)


def _decode(model, prompts, owners, mesh, state, settings: SamplingSettings, device, chunk: int, *,
            lockstep: bool, on_host: bool) -> list[list[int]]:
    """The prefill and the decode loop (see the module docstring); returns the completions."""
    n = len(prompts)
    binding, logits = prefill(model, prompts, mesh, state, max_new_tokens=settings.max_new_tokens,
                              pad_token_id=settings.pad_token_id, device=device, chunk=chunk, on_host=on_host)
    mine = [i for i in range(n) if owners[i] == mesh.sp_rank]
    mine_idx = torch.tensor(mine, dtype=torch.long, device=device)
    sampler = OwnerSampler(settings, [prompts[i] for i in mine], device)
    completions: list[list[int]] = [[] for _ in range(n)]
    alive = [True] * n
    eos = set(settings.eos_token_ids)
    order, width = token_order(owners, mesh.sp, device)
    step = 0
    while True:
        ids, tokens = share_tokens(sampler.sample(logits.index_select(0, mine_idx)), order, width, mesh)  # [N] both
        for i, t in enumerate(tokens):
            if alive[i]:
                completions[i].append(t)
                alive[i] = t not in eos
        sampler.finish_step([alive[i] for i in mine])
        group_more = any(alive) and step + 1 < settings.max_new_tokens
        more = group_more
        while True:
            if lockstep and mesh.world_size > 1:  # FSDP2 gathers per forward: every DP group steps together
                flag = torch.tensor([1.0 if group_more else 0.0], device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=mesh.world_mesh.get_group())  # [1]: any group left
                more = bool(flag.item())
            if not more or group_more:
                break
            binding.begin_step(step, dummy=True)  # only FSDP2's collectives: this group is done
            pads = torch.full((1, n), settings.pad_token_id, device=device)  # [1, N]
            model(input_ids=pads, position_ids=binding.prompt_lengths[None])
        if not more:
            return completions
        binding.begin_step(step)
        logits = model(input_ids=ids[None], position_ids=binding.query_pos[None]).logits[0].float()  # [N, V]
        step += 1
