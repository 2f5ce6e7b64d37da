"""GRPO rollouts on a sequence-parallel, FSDP2-sharded model: no hang when ranks generate
different lengths, and the same completions on every rank of an SP group.

Where it sits: first half of a GRPO step (DeepSeekMath §4.1: G completions per prompt),
before `grpo.loss.pack_completions`. `unpatched_for_generation` all-gathers every FSDP2 unit
ONCE (same calls, same order on every rank) and keeps it unsharded, suspends the SP patch so
transformers' own generation runs (KV cache, sampling, stopping), then puts the same patch
back (`model_patch.suspended`: nothing re-validated or probed) and reshards: the forwards
inside `generate` make no collective, so each rank decodes as long as it needs. `sp_rollouts` splits the SP group's prompts over its ranks and
all-gathers the completions, so the group trains on the same completions. Memory: the whole
unsharded model during generation. vLLM is never imported. Why: DESIGN "GRPO under SP"."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from hf_longctx.generation.weights import gathered
from hf_longctx.integrations.model_patch import suspended
from hf_longctx.training.refusals.grpo import check_grpo_config


@contextmanager
def unpatched_for_generation(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Inside: `model` is a plain HF model with full local weights (see the module docstring);
    `model.generate` may run any number of steps per rank. A collective on entry and on exit
    (FSDP all-gathers / none), the same on every rank. The patch is suspended, not re-made: on
    exit the same patch (options, dry-run report, registration) is back and the units resharded."""
    was_training = model.training
    with gathered(model), suspended(model):  # every FSDP2 unit all-gathered once, in module order
        model.eval()
        try:
            yield model
        finally:
            model.train(was_training)


def _gather_lists(mine: Any, group) -> list[Any]:
    """all_gather of a picklable object (ragged token lists) over `group`: [group size] x object."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)  # ragged: pickled objects, not padded tensors
    return out


def sp_rollouts(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], mesh, *, num_generations: int,
    generate: Callable[[torch.nn.Module, list[int], int], list[list[int]]],
) -> list[list[int]]:
    """Completions of this SP group's `prompts` (the same list on every rank of the group),
    `num_generations` per prompt, prompt-major (TRL's order): the group's ranks split the
    prompts, each calls `generate(model, prompt, n)` -> n token lists (the completion tokens,
    up to and including EOS) on the unpatched, gathered model, and the lists are all-gathered
    over the SP group. Identical on every rank of the group."""
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}")
    sp, r = mesh.sp, mesh.sp_rank
    mine_idx = list(range(r, len(prompts), sp))  # round-robin: ranks share the prompts ≈ evenly
    with unpatched_for_generation(model):
        mine = [generate(model, list(prompts[i]), num_generations) for i in mine_idx]
    for i, outs in zip(mine_idx, mine):
        if len(outs) != num_generations:
            raise ValueError(f"generate returned {len(outs)} completions for prompt {i}, expected {num_generations}")
    if sp > 1:
        key = hash(tuple(tuple(int(t) for t in p) for p in prompts))  # the group's prompts, as this rank sees them
        table = _gather_lists([key, [list(map(list, o)) for o in mine]], mesh.sp_group)  # [SP] x [key, lists]
        keys = [k for k, _ in table]
        if len(set(keys)) > 1:  # every rank sees the same table: all raise together
            raise ValueError(
                f"the ranks of one SP group passed different prompts to sp_rollouts (per-rank hashes {keys}); every "
                "rank of an SP group must pass the same prompts -- draw them by DP rank, not by global rank")
        per_rank = [lists for _, lists in table]
    else:
        per_rank = [mine]
    by_prompt: list[Any] = [None] * len(prompts)
    for rank, outs in enumerate(per_rank):
        for i, o in zip(range(rank, len(prompts), sp), outs):
            by_prompt[i] = o
    return [c for outs in by_prompt for c in outs]


def hf_generate(max_new_tokens: int, eos_token_id: int, pad_token_id: int = 0, **sampling: Any) -> Callable:
    """A `generate` for `sp_rollouts` over `model.generate` (transformers' own path): n
    samples of one prompt, cut after the first EOS (TRL's completion_mask). `synced_gpus=False`:
    transformers turns it on for FSDP-managed models (an all-reduce per decoded token so that
    every rank keeps stepping until all finish); inside `unpatched_for_generation` the forwards
    make no collective, and that per-token all-reduce would deadlock as soon as ranks call
    `generate` different numbers of times (an SP group's prompts do not split evenly)."""

    def run(model: torch.nn.Module, prompt: list[int], n: int) -> list[list[int]]:
        ids = torch.tensor([prompt] * n, device=next(model.parameters()).device)  # [n, P]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             eos_token_id=eos_token_id, pad_token_id=pad_token_id, synced_gpus=False,
                             **sampling)  # [n, P + C_max]
        rows = []
        for row in out[:, len(prompt):].tolist():
            rows.append(row[: row.index(eos_token_id) + 1] if eos_token_id in row else row)
        return rows

    return run


def generation_kwargs(args: Any) -> dict[str, Any]:
    """The sampling kwargs of `hf_generate` from a GRPOConfig (TRL's transformers path: sampling on,
    its temperature / top_p / top_k / min_p / repetition_penalty / cache_implementation, then
    `generation_kwargs` on top)."""
    check_grpo_config(args)
    out = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
               repetition_penalty=args.repetition_penalty, cache_implementation=args.cache_implementation)
    out.update(args.generation_kwargs or {})
    return out


GENERATION = ("sp", "per-rank")


def check_generation(generation: str, args: Any) -> str:
    """`generation` of a rollout trainer, checked with TRL's sampling fields of `args` (a GRPOConfig /
    RLOOConfig): "sp" refuses, before any collective, an option sequence-parallel generation does not
    apply (`generation/settings.py`); "per-rank" runs TRL's own generate (this module)."""
    if generation not in GENERATION:
        raise ValueError(f"generation must be one of {GENERATION}, got {generation!r}")
    if generation == "sp" and args is not None:
        from hf_longctx.generation.settings import sampling_settings

        options = dict(max_new_tokens=args.max_completion_length, do_sample=True, temperature=args.temperature,
                       top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty)
        options.update(args.generation_kwargs or {})  # TRL merges them last
        sampling_settings(**options)
    return generation
