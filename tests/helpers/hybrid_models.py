"""Tiny hybrid models (linear mixers + attention) and their per-document reference.

`hybrid_config(family)` builds a config that forces every branch of the mixer exchange
schemes (uneven head splits, heads spanning key heads, short convolutions of kernel 3 and
4, Mamba-2 with 1 and 2 groups, scan chunks of 4); `build` makes the model (seeded, fp32,
train mode). `packed_batch` packs unequal documents, one shorter than every conv kernel.
`per_document_reference` runs the UNPATCHED model one document at a time (transformers'
own torch mixer paths would leak state across packed documents), normalised so the
documents' losses sum to the packed loss; `sp_run` is the patched run on this rank's
shard. `heads_scheme` pins the head all-to-all for the GDN and Mamba-2 families; `_rows`
is the pool task of the B = 2 rows-of-one-document case.
"""

from __future__ import annotations

import torch

from tests.helpers.families import compare
from tests.helpers.pool import worker_mesh

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
    """tests/distributed/test_hybrid_models.py tests the head all-to-all of the GDN and Mamba-2
    families (pinned: the default "auto" may pass their state instead,
    tests/distributed/test_hybrid_state.py); the short convolutions and the RG-LRU have one
    scheme each."""
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


def _rows(families: list, scheme: str = "heads") -> dict:
    """B = 2 rows of one document each (right padding by attention_mask): shard_batch pads each
    row's document; the mixers run per row (batch dimension) from zero state."""
    from hf_longctx.integrations.model_patch import patch

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
