"""The tiny models, packed batch and one patched step shared by the row-chunked layer tests
(tests/distributed/test_layer_split.py, test_keep_attention_max.py): a step returns the loss and
every gradient summed over the SP group, and the layer runs the split recorded."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_longctx.data.sharding import shard_batch
from hf_longctx.integrations.model_patch import patch, patch_state, unpatch
from tests.helpers.reference import rel_err

LOSS_TOL, GRAD_TOL = 1e-6, 1e-5
DOCS = [13, 29, 7, 47]


def _model(family: str):
    """The families of tests/helpers/recompute_models.py, and Qwen3 (per-head q/k norms inside
    the attention module) and GPT-2 without dropout (Conv1D, learned positions, cache and masks
    passed by position)."""
    import transformers as tf

    from tests.helpers.recompute_models import _model as shared

    torch.manual_seed(0)
    if family == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                                  max_position_embeddings=256, head_dim=8))
    if family == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=256,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return shared(family)


def _batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, sum(DOCS)), generator=g)
    pos = torch.cat([torch.arange(n) for n in DOCS])[None]  # [1, S] per-document positions
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}


def _step(model, mesh, batch, shard_mesh=None, **options):
    """One patched training step: (loss and every gradient flattened, summed over the SP group;
    what the patch counted: the split's layer runs, or the keeper's replays as {"replayed": n}).
    `mesh`: what patch() gets (an SPMesh or a GroupBank); `shard_mesh`: the batch's SP group
    (default `mesh`)."""
    shard_mesh = mesh if shard_mesh is None else shard_mesh
    patch(model, mesh, **options)
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # dropout masks: the same draws in every mode
    loss = model(**shard_batch(batch, shard_mesh)).loss
    loss.backward()
    flat = torch.cat([loss.detach().reshape(1)] + [
        (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in model.parameters()]).float()
    if shard_mesh.sp > 1:
        dist.all_reduce(flat, group=shard_mesh.sp_group)  # losses and gradients SUM over the SP group
    state = patch_state(model)
    runs = dict(state.split.runs) if state.split is not None else {}
    if state.keeper is not None:
        runs["replayed"] = state.keeper.replayed
    unpatch(model)
    return flat, runs


def errors_by_name(base, got: torch.Tensor, ref: torch.Tensor) -> dict:
    """{"loss" or parameter name: relative error} of two flat `_step` results of `base`'s
    parameters; parameters whose reference gradient is zero everywhere are left out."""
    sizes = [1] + [p.numel() for p in base.parameters()]
    names = ["loss"] + [n for n, _ in base.named_parameters()]
    return {n: rel_err(a, b) for n, a, b in zip(names, got.split(sizes), ref.split(sizes)) if b.abs().max() > 0 or n == "loss"}


def assert_exact(errs: dict, rank: int, family: str) -> None:
    """The loss within LOSS_TOL and every gradient within GRAD_TOL (fp32: see the tolerances)."""
    assert errs.pop("loss") <= LOSS_TOL, f"rank {rank}: loss"
    bad = {k: f"{e:.1e}" for k, e in errs.items() if e > GRAD_TOL}
    assert not bad, f"rank {rank} {family}: gradient rel errs above {GRAD_TOL}: {bad}"
