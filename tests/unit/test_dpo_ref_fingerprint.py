"""The pieces of the stored reference columns' checks, without a trainer.

`ids_hashes` (arrow, no Python lists) equals `ids_hash` row by row on a dataset, a selection
and a shuffled filter; `model_digest` is equal for the same weights in fp32 and bf16 and after
`patch(memory="max")`, and differs for other weights."""

from __future__ import annotations

import torch


def _pairs():
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, 64, (n,), generator=g).tolist()  # noqa: E731
    return Dataset.from_list([{"prompt_ids": ids(i % 3), "chosen_ids": ids(2 + i % 4), "rejected_ids": ids(1 + i % 5)}
                              for i in range(12)])


def test_ids_hashes_equal_the_row_hash():
    from hf_longctx.training.dpo.ref_columns import ids_hash
    from hf_longctx.training.dpo.ref_fingerprint import ids_hashes

    pairs = _pairs()
    evens = pairs.shuffle(seed=1).filter(lambda r, i: i % 2 == 0, with_indices=True)
    for ds in (pairs, pairs.select([7, 2, 9]), evens):
        want = [ids_hash(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in ds]
        assert ids_hashes(ds).tolist() == want


def test_model_digest_reads_weights_not_dtype():
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_longctx import init_sequence_parallel, patch
    from hf_longctx.training.dpo.model_digest import model_digest

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    digest = model_digest(model)
    assert model_digest(LlamaForCausalLM(cfg)) != digest  # other weights
    other = LlamaForCausalLM(cfg)
    other.load_state_dict(model.state_dict())
    assert model_digest(other.to(torch.bfloat16)) == digest
    assert model_digest(patch(model, init_sequence_parallel(), memory="max")) == digest
