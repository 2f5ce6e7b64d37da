"""checkpoint="attention" (integrations/checkpoint_attention.py): exact, and the attention really is
not recomputed.

Exactness: on every layout (Ulysses, ring, U×R with zigzag, FPDT chunks with and without K/V
offload, flexible groups), with sliding windows, attention sinks, a hybrid's linear mixers
and dropout, one training step with checkpoint="attention" gives the loss and EVERY gradient
of the same step with checkpoint=True and with no checkpointing. Tolerances (fp32): loss 1e-6
relative, gradients 1e-5 relative (max|a-b| / max|b| per parameter). The
three modes run the same kernels on the same inputs; only the order in which autograd sums
the same terms may differ, ~1e-7 in fp32, while a replayed output of the wrong call, a lost
saved tensor or a dropout mask drawn twice moves a gradient by >= 1e-2.

Counts: per step and layer, the attention kernel's forward
runs once with keep-attention (twice with checkpoint=True) and the attention's collectives
run as often as without checkpointing (Ulysses 2, q/k/v in one all-to-all: 2 forward + 2
backward = 4; checkpoint=True: 6). Checked to fail: with the keeper's replay disabled (every recompute
runs the attention again) the counts are those of checkpoint=True.
"""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks.recompute import Collectives
from hf_longctx.data.sharding import shard_batch
from hf_longctx.integrations.model_patch import patch, patch_state, unpatch
from tests.helpers.pool import worker_mesh
from tests.helpers.layer_split_cases import _step
from tests.helpers.reference import rel_err
from tests.helpers.recompute_models import _model

LOSS_TOL, GRAD_TOL = 1e-6, 1e-5
DOCS = [13, 29, 7, 31]
MODES = (False, True, "attention")


def _batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, sum(DOCS)), generator=g)
    pos = torch.cat([torch.arange(n) for n in DOCS])[None]  # [1, S] per-document positions
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}


def _exact_case(family: str, ulysses: int, ring: int, chunks: int, kv_offload: bool, bank: bool,
                dtype: torch.dtype = torch.float32):
    mesh = worker_mesh(ulysses, ring, chunks)
    base = _model(family).to(dtype)
    batch = _batch(base.config.vocab_size)
    if bank:
        from hf_longctx import init_group_bank

        mesh_or_bank = init_group_bank(heads=4)
        sp_mesh = mesh_or_bank.mesh(mesh_or_bank.max_size)
    else:
        mesh_or_bank = sp_mesh = mesh
    flats = {}
    for mode in MODES:
        flats[mode], runs = _step(copy.deepcopy(base), mesh_or_bank, batch, sp_mesh, checkpoint=mode,
                                  kv_offload=kv_offload)
        if mode == "attention":
            replayed = runs["replayed"]
    sizes = [1] + [p.numel() for p in base.parameters()]
    names = ["loss"] + [n for n, _ in base.named_parameters()]
    errs = {}
    for other in (False, True):
        parts = zip(names, flats["attention"].split(sizes), flats[other].split(sizes))
        errs[str(other)] = {n: rel_err(a, b) for n, a, b in parts if b.abs().max() > 0 or n == "loss"}
    return errs, replayed


LAYOUTS = [  # (world, family, ulysses, ring, fpdt chunks, kv_offload, group bank)
    (2, "llama", 2, 1, 1, False, False),
    (2, "llama", 1, 2, 1, False, False),
    (4, "llama", 2, 2, 1, False, False),
    (2, "llama", 2, 1, 2, False, False),
    (2, "llama", 2, 1, 2, True, False),
    (2, "mistral", 1, 2, 1, False, False),
    (2, "gpt_oss", 2, 1, 1, False, False),
    (2, "gpt2_dropout", 1, 2, 1, False, False),
    (2, "lfm2", 2, 1, 1, False, False),
    (4, "llama", 2, 2, 1, False, True),
]


@pytest.mark.parametrize("world,family,ulysses,ring,chunks,kv_offload,bank", LAYOUTS,
                         ids=[f"{f}-u{u}r{r}c{c}{'-kvoff' if o else ''}{'-bank' if b else ''}"
                              for _, f, u, r, c, o, b in LAYOUTS])
def test_keep_attention_equals_full_and_no_checkpoint(pools, world, family, ulysses, ring, chunks, kv_offload, bank):
    for rank, (errs, replayed) in enumerate(pools.get(world).run(_exact_case, family, ulysses, ring, chunks,
                                                                 kv_offload, bank)):
        assert replayed > 0, f"rank {rank}: no attention call was replayed (keep-attention not in effect)"
        for other, per in errs.items():
            assert per.pop("loss") <= LOSS_TOL, f"rank {rank} vs checkpoint={other}: loss"
            bad = {k: f"{e:.1e}" for k, e in per.items() if e > GRAD_TOL}
            assert not bad, f"rank {rank} {family} vs checkpoint={other}: gradient rel errs above {GRAD_TOL}: {bad}"


# ---- counts: the attention runs once per step ---------------------------------------------------


def _counts_case(layers: int, replay: bool):
    import transformers as tf

    from hf_longctx.ops import kernels

    mesh = worker_mesh(2, 1, 1)
    torch.manual_seed(0)
    base = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=96))
    batch = _batch(96)
    out = {}
    original = kernels.varlen_forward
    for mode in MODES:
        model = copy.deepcopy(base)
        patch(model, mesh, checkpoint=mode)
        if not replay and mode == "attention":
            patch_state(model).keeper.replaying = lambda: False  # the check of the test: recompute as before
        model.train()
        shard = shard_batch(batch, mesh)
        calls = [0]

        def counted(*args, **kwargs):
            calls[0] += 1
            return original(*args, **kwargs)

        kernels.varlen_forward = counted
        try:
            with Collectives() as mode_counter:
                model(**shard).loss.backward()
        finally:
            kernels.varlen_forward = original
        out[str(mode)] = (calls[0], mode_counter.n)
        unpatch(model)
    return out


def test_keep_attention_runs_the_attention_and_its_collectives_once(pools):
    """Per layer = (4-layer count - 2-layer count) / 2, so the embedding/loss collectives do not count."""
    for replay in (True, False):
        lo = pools.get(2).run(_counts_case, 2, replay)[0]
        hi = pools.get(2).run(_counts_case, 4, replay)[0]
        per_layer = {m: tuple((h - l) / 2 for h, l in zip(hi[m], lo[m])) for m in hi}
        kernels_none, coll_none = per_layer["False"]
        kernels_full, coll_full = per_layer["True"]
        # Ulysses 2 with q, k, v in ONE all-to-all: forward 2 (q/k/v in, out back), backward 2; full recompute
        # repeats the forward's 2 ("8 vs 12" when q, k, v and out count as four all-to-alls)
        assert coll_none == 4 and coll_full == 6, per_layer
        assert kernels_full == 2 * kernels_none, per_layer  # full recompute runs the forward kernel twice
        if replay:
            assert per_layer["attention"] == (kernels_none, coll_none), per_layer
        else:  # the test's own check: without the replay keep-attention counts as full recompute
            assert per_layer["attention"] == (kernels_full, coll_full), per_layer


def test_keep_attention_in_bf16_equals_full_checkpointing(pools):
    """bf16 (the default training dtype), U2×R2: keep-attention runs the same bf16 kernels on
    the same inputs as checkpoint=True, so loss and gradients agree within one bf16 rounding
    of autograd's summation order (2 ULPs, 2 x 2^-8 relative to each gradient's largest value)."""
    for rank, (errs, replayed) in enumerate(pools.get(4).run(_exact_case, "llama", 2, 2, 1, False, False, torch.bfloat16)):
        assert replayed > 0
        per = errs["True"]
        assert per.pop("loss") <= 2 * 2**-8, f"rank {rank}: loss"
        bad = {k: f"{e:.1e}" for k, e in per.items() if e > 2 * 2**-8}
        assert not bad, f"rank {rank}: bf16 gradient rel errs vs checkpoint=True above 2 ULPs: {bad}"
