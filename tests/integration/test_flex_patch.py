"""patch(model, GroupBank) in one process: the batch's group selects the mesh, size 1 runs
local attention, and a batch laid out for a group the model cannot run is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.families import packed_batch, rel


@pytest.fixture(scope="module")
def model_cls():
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2)
    return lambda: tf.LlamaForCausalLM(cfg).train()


def test_bank_patch_size_one_equals_unpatched(model_cls):
    from hf_longctx import init_group_bank, patch, shard_batch, unpatch

    torch.manual_seed(0)
    model = model_cls()
    batch = packed_batch()
    ref = model(**batch, use_cache=False).loss
    bank = init_group_bank(heads=4)  # one process: the bank holds only size 1
    assert bank.sizes == (1,) and bank.group_index(1) == 0
    patch(model, bank)
    shard = shard_batch(batch, bank.mesh(1))
    assert shard["sp_batch"].group == (1, 0)
    assert rel(model(**shard).loss, ref) <= 1e-6  # size 1: local varlen attention, same math
    bad = dict(shard, sp_batch=dataclasses.replace(shard["sp_batch"], group=(2, 0)))
    with pytest.raises(ValueError, match="no group of size 2"):
        model(**bad)
    unpatch(model)


def test_mesh_patch_refuses_a_batch_for_another_group(model_cls):
    from hf_longctx import init_sequence_parallel, patch, shard_batch

    model = model_cls()
    mesh = init_sequence_parallel()
    patch(model, mesh)
    shard = shard_batch(packed_batch(), mesh)
    bad = dict(shard, sp_batch=dataclasses.replace(shard["sp_batch"], group=(4, 1)))
    with pytest.raises(ValueError, match=r"sharded for SP group \(size 4, index 1\)"):
        model(**bad)


@pytest.mark.parametrize("kind", ["mesh", "bank"])
def test_a_batch_for_another_group_of_the_same_size_is_refused(model_cls, kind):
    """The patch() mesh and a bank resolve a batch's group alike: a group of a size they hold
    but another index (the ranks [1, 2), not this rank's) is refused naming both groups."""
    from hf_longctx import init_group_bank, init_sequence_parallel, patch, shard_batch, unpatch
    from hf_longctx.integrations.model_patch import patch_state

    model = model_cls()
    given = init_sequence_parallel() if kind == "mesh" else init_group_bank(heads=4)
    patch(model, given)
    assert patch_state(model).bank is given and patch_state(model).mesh is given.patch_mesh
    shard = shard_batch(packed_batch(), given.mesh(1))
    bad = dict(shard, sp_batch=dataclasses.replace(shard["sp_batch"], group=(1, 1)))
    with pytest.raises(ValueError, match=r"sharded for SP group \(size 1, index 1\), which covers ranks \[1, 2\); "
                                         r"rank 0's own group of that size is 0"):
        model(**bad)
    unpatch(model)
