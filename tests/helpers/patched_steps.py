"""Steps of a patched model on one process: the loss and gradients of its last step, for tests
that hold a memory option against memory="off" (fp32, a packed row of two documents)."""

from __future__ import annotations

import torch


def patched_steps(model, steps: int = 2, tokens: tuple = (50, 40), **options) -> tuple:
    """(loss, [grad per parameter], the patch's LayerSplit's learnt skips ({} without one), model)
    after `steps` forward+backward steps of `model` patched with `options` on a 1x1 mesh, then
    unpatched. The second step's `post` runs use what the first backward learnt."""
    from hf_longctx import init_sequence_parallel
    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.integrations.model_patch import patch, patch_state, unpatch

    mesh = init_sequence_parallel(1, 1)
    patch(model, mesh, **options)
    model.train()
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(1, vocab, (1, sum(tokens)), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in tokens])[None]
    shard = shard_batch({"input_ids": ids, "labels": ids.clone(), "position_ids": pos}, mesh)
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        loss = model(**shard).loss
        loss.backward()
    split = patch_state(model).split
    learnt = dict(split.skippable) if split is not None else {}
    unpatch(model)
    return loss.detach(), [p.grad for p in model.parameters()], learnt, model


def worst_errors(got: tuple, ref: tuple) -> tuple[float, float]:
    """(relative loss error, largest gradient error over the largest reference gradient; inf
    where a parameter has a gradient in one run and none in the other)."""
    loss, grads = got[0], got[1]
    ref_loss, ref_grads = ref[0], ref[1]
    if any((a is None) != (b is None) for a, b in zip(grads, ref_grads)):
        return float((loss - ref_loss).abs() / ref_loss.abs().clamp_min(1e-30)), float("inf")
    top = max(float(g.abs().max()) for g in ref_grads if g is not None) or 1e-30
    grad = max((float((a - b).abs().max()) / top for a, b in zip(grads, ref_grads) if b is not None), default=0.0)
    return float((loss - ref_loss).abs() / ref_loss.abs().clamp_min(1e-30)), grad
