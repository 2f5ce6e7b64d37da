"""Hybrid models (linear mixers + attention) under SP vs the UNPATCHED model run one document
at a time: loss and every gradient.

The reference is per document because transformers' own torch paths of the linear mixers
(convolutions, Gated DeltaNet) ignore document boundaries when documents are packed by
position_ids: they would leak state across documents, and comparing with that would be
comparing with a wrong answer. Each reference document gets `num_items_in_batch` = the
packed batch's valid-target count, so the per-document losses add up to the packed loss.

The GDN and Mamba-2 families run the head all-to-all (`mixers="heads"`). Configs are tiny
and built to force every branch of the schemes: GDN key heads 2 / value
heads 4 (split by key head on 2 ranks, q/k replicated on 4), an odd head count (Qwen3-Next
1 key / 3 value heads: uneven value split on 2 ranks), OLMo-hybrid 3 key / 6 value heads on
4 ranks (a rank's value heads span two key heads), LFM2 short convolutions of kernel 3 and 4,
Mamba-2 with n_groups 1 (Granite-4, Nemotron-H) and 2 (Bamba, Zamba2) on 4 ranks (B/C
replicated), Falcon-H1 with 3 heads (uneven), scan chunks of 4 (several per document).
The batch holds unequal documents, one shorter than every conv kernel, plus padding on
every mesh (zigzag chunks of 1-2 tokens: the halo comes from several ranks).

Tolerances (relative, max|a-b| / max|b|), fp32: loss 1e-5, gradients 1e-4, as in
`test_models.py` (summation order only); a leak across documents or a lost halo gives 1e-2+.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.families import compare
from tests.helpers.pool import worker_mesh

LOSS_TOL = 1e-5
GRAD_TOL = 1e-4
DOCS = [13, 2, 9, 6]  # 2 < every conv kernel; total 30 pads on every mesh


def hybrid_config(family: str):
    import transformers as tf

    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "lfm2":  # kernel 3 (conv_L_cache); conv, attention, conv
        return tf.Lfm2Config(**small, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3, conv_bias=True)
    if family == "lfm2_k4":  # kernel 4: a halo of 3 rows spans 3 zigzag chunks of 1 token on ring 4
        return tf.Lfm2Config(**small, layer_types=["conv", "full_attention", "conv"], conv_L_cache=4)
    gdn = dict(linear_key_head_dim=4, linear_value_head_dim=4, linear_conv_kernel_dim=4,
               layer_types=["linear_attention", "full_attention", "linear_attention"])
    if family == "qwen3_5_text":  # key heads 2 / value heads 4
        return tf.Qwen3_5TextConfig(**small, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, **gdn)
    if family == "qwen3_next":  # odd: 1 key head / 3 value heads; a MoE block on every layer
        return tf.Qwen3NextConfig(
            **small, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=3, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, shared_expert_intermediate_size=16, **gdn,
        )
    if family == "olmo_hybrid":  # 3 key / 6 value heads; beta in [0, 2]
        return tf.OlmoHybridConfig(**small, linear_num_key_heads=3, linear_num_value_heads=6, **gdn)
    if family == "qwen3_5_moe_text":
        return tf.Qwen3_5MoeTextConfig(
            **small, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, shared_expert_intermediate_size=16, **gdn,
        )
    if family == "lfm2_moe":
        return tf.Lfm2MoeConfig(**small, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3, num_dense_layers=1,
                                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    m2 = dict(mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=4)  # chunk 4: several scan chunks per document
    if family == "bamba":  # 4 heads, n_groups 2: on 4 ranks each group's B/C go to 2 ranks
        return tf.BambaConfig(**small, attn_layer_indices=[1], mamba_n_heads=4, mamba_n_groups=2, **m2)
    if family == "granitemoehybrid":  # n_groups 1 (B/C replicated to every rank), conv kernel 3
        return tf.GraniteMoeHybridConfig(
            **small, layer_types=["mamba", "attention", "mamba"], mamba_n_heads=4, mamba_n_groups=1,
            num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=16, **{**m2, "mamba_d_conv": 3},
        )
    if family == "falcon_h1":  # odd: 3 heads (uneven split on 2 ranks); attention and Mamba-2 in parallel in every layer
        return tf.FalconH1Config(**{**small, "num_hidden_layers": 2}, mamba_d_ssm=24, mamba_n_heads=3, mamba_d_head=8,
                                 mamba_n_groups=1, mamba_rms_norm=True, **m2)
    if family == "nemotron_h":  # n_groups 1
        return tf.NemotronHConfig(
            **{k: v for k, v in small.items() if k != "num_hidden_layers"}, head_dim=4,
            layers_block_type=["mamba", "attention", "mamba"], ssm_state_size=4, mamba_num_heads=4, mamba_head_dim=8,
            n_groups=1, conv_kernel=4, expand=2, chunk_size=4,
        )
    if family == "zamba2":  # shared hybrid attention blocks; n_groups 2
        return tf.Zamba2Config(
            **small, layers_block_type=["mamba", "hybrid", "mamba"], mamba_d_state=4, mamba_d_conv=4,
            mamba_expand=2, mamba_ngroups=2, n_mamba_heads=4, chunk_size=4,
        )
    if family == "recurrent_gemma":  # RG-LRU: halo conv of width 4, state passing; local sliding attention
        return tf.RecurrentGemmaConfig(
            **{k: v for k, v in small.items() if k not in ("bos_token_id", "eos_token_id")}, lru_width=16,
            attention_window_size=64, conv1d_width=4, block_types=("recurrent", "attention", "recurrent"),
        )
    raise KeyError(family)


def build(family: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hybrid_config(family), dtype=torch.float32)
    return model.train()


def packed_batch(docs=DOCS, seed: int = 0, vocab: int = 64) -> dict:
    from transformers import DataCollatorWithFlattening

    g = torch.Generator().manual_seed(seed)
    features = [{"input_ids": torch.randint(1, vocab, (n,), generator=g).tolist()} for n in docs]
    return DataCollatorWithFlattening(return_position_ids=True, return_tensors="pt")(features)


def heads_scheme(family: str) -> str | None:
    """This file tests the head all-to-all of the GDN and Mamba-2 families (pinned: the default
    "auto" may pass their state instead, tests/distributed/test_hybrid_state.py); the short
    convolutions and the RG-LRU have one scheme each."""
    return None if family.startswith(("lfm2", "recurrent_gemma")) else "heads"


def per_document_reference(model, batch: dict):
    """Loss and gradients of the unpatched model, one document at a time, normalised by the
    valid-target count of the whole packed batch (so they sum to the packed loss)."""
    pos = batch["position_ids"][0]
    starts = [0, *(torch.nonzero(pos[1:] != pos[:-1] + 1)[:, 0] + 1).tolist(), pos.numel()]
    n_items = sum(b - a - 1 for a, b in zip(starts[:-1], starts[1:]))
    model.zero_grad(set_to_none=True)
    total = 0.0
    for a, b in zip(starts[:-1], starts[1:]):
        ids = batch["input_ids"][:, a:b]
        out = model(input_ids=ids, labels=ids, num_items_in_batch=n_items, use_cache=False)
        out.loss.backward()
        total = total + out.loss.detach()
    return total, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def sp_run(model, batch, mesh):
    from tests.helpers.families import sp_loss_and_grads

    loss, _, grads = sp_loss_and_grads(model, batch, mesh)
    return loss, grads


def _families(ulysses: int, ring: int, families: list, docs=DOCS, fpdt_chunks: int = 1) -> dict:
    from hf_longctx.integrations.transformers import patch

    mesh = worker_mesh(ulysses, ring, fpdt_chunks=fpdt_chunks)
    batch = packed_batch(docs)
    out = {}
    for family in families:
        ref_loss, ref_grads = per_document_reference(build(family), batch)
        loss, grads = sp_run(patch(build(family), mesh, mixers=heads_scheme(family)), batch, mesh)
        out[family] = compare(ref_loss, ref_grads, loss, grads)
    return out


def _assert_exact(results, ulysses, ring):
    for rank, per_family in enumerate(results):
        for family, errs in per_family.items():
            where = f"{family} mesh U×R = {ulysses}×{ring} rank {rank}: {errs}"
            assert "missing_grads" not in errs, where
            assert errs["loss"] <= LOSS_TOL and errs["grad"] <= GRAD_TOL, where


# Full cross product of meshes for the GDN family; fewer for the others (CI budget).
CASES = [
    (2, 2, 1, ["qwen3_5_text", "lfm2", "qwen3_next", "falcon_h1"]),
    (2, 1, 2, ["qwen3_5_text", "lfm2_k4", "qwen3_next", "falcon_h1", "zamba2", "recurrent_gemma"]),
    (4, 2, 2, ["qwen3_5_text", "lfm2", "olmo_hybrid", "bamba", "nemotron_h", "recurrent_gemma"]),
    (4, 4, 1, ["qwen3_5_text", "olmo_hybrid", "granitemoehybrid", "lfm2_moe"]),
    (4, 1, 4, ["qwen3_5_text", "lfm2_k4", "bamba", "qwen3_5_moe_text", "zamba2", "recurrent_gemma"]),
]


@pytest.mark.parametrize("world,ulysses,ring,families", CASES, ids=[f"w{w}-u{u}r{r}" for w, u, r, _ in CASES])
def test_hybrid_matches_per_document_reference(pools, world, ulysses, ring, families):
    results = pools.get(world).run(_families, ulysses, ring, families, timeout=300)
    _assert_exact(results, ulysses, ring)


def test_rglru_exchange_backward_runs_on_every_rank(pools):
    """U=2 on documents [13, 8, 9]: rank 0's runs both start documents, so it uses none of the
    RG-LRU summaries it receives while rank 1 does. The exchange's backward is a collective:
    autograd pruned it on rank 0 and the ranks mismatched (gloo abort / hang) before the fix."""
    _assert_exact(pools.get(2).run(_families, 2, 1, ["recurrent_gemma"], [13, 8, 9], timeout=120), 2, 1)


def _without_wrappers(family: str) -> dict:
    """The same patched model with the mixer wrappers taken off: its mixers then run on each
    shard as if it were the whole sequence. The test must see the difference."""
    from hf_longctx.integrations.transformers import _STATE_ATTR, patch

    mesh = worker_mesh(2, 2)
    batch = packed_batch()
    ref_loss, ref_grads = per_document_reference(build(family), batch)
    model = patch(build(family), mesh, mixers=heads_scheme(family))
    state = model.__dict__[_STATE_ATTR]
    state.mixers.restore()
    state.mixers = None
    loss, grads = sp_run(model, batch, mesh)
    return compare(ref_loss, ref_grads, loss, grads)


def test_without_wrappers_gradients_are_wrong(pools):
    for family in ("qwen3_5_text", "lfm2", "bamba", "recurrent_gemma"):
        for rank, errs in enumerate(pools.get(4).run(_without_wrappers, family, timeout=300)):
            assert errs["grad"] > 100 * GRAD_TOL, f"{family} rank {rank}: unwrapped mixers look exact {errs}"


def test_hybrid_under_fpdt_chunks(pools):
    """FPDT's rank-ordinal chunk layout: the mixers exchange the whole sequence (they are not
    chunked), so they are exact under it too; only attention runs chunk by chunk."""
    families = ["qwen3_5_text", "lfm2", "bamba"]
    _assert_exact(pools.get(2).run(_families, 2, 1, families, DOCS, 2, timeout=300), 2, 1)


def _rows(families: list, scheme: str = "heads") -> dict:
    """B = 2 rows of one document each (right padding by attention_mask): shard_batch pads each
    row's document; the mixers run per row (batch dimension) from zero state."""
    from hf_longctx.integrations.transformers import patch

    mesh = worker_mesh(1, 2)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 64, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    out = {}
    for family in families:
        ref = build(family)
        ref.zero_grad(set_to_none=True)
        n_items = 11 + 8
        for row, n in ((0, 12), (1, 9)):  # every row alone, without its padding
            r = ids[row : row + 1, :n]
            ref(input_ids=r, labels=r, num_items_in_batch=n_items, use_cache=False).loss.backward()
        ref_grads = {k: p.grad.detach().clone() for k, p in ref.named_parameters() if p.grad is not None}
        ref_loss = sum(  # loss of the same reference, recomputed without gradients
            ref(input_ids=ids[i : i + 1, :n], labels=ids[i : i + 1, :n], num_items_in_batch=n_items, use_cache=False).loss.detach()
            for i, n in ((0, 12), (1, 9))
        )
        mixers = scheme if heads_scheme(family) else None  # GDN / Mamba-2: the scheme asked for
        loss, grads = sp_run(patch(build(family), mesh, mixers=mixers), batch, mesh)
        out[family] = compare(ref_loss, ref_grads, loss, grads)
    return out


def test_hybrid_rows_of_one_document(pools):
    _assert_exact(pools.get(2).run(_rows, ["qwen3_5_text", "lfm2", "bamba", "recurrent_gemma"], timeout=300), 1, 2)
