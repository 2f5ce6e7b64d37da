"""pack_completions (training/grpo/loss.py): per-completion values land at the positions whose
shifted label is that completion's token, through shard_batch (world-1 mesh), with the
loss_type weights of TRL's normalisers; bad input raises naming the values."""

from __future__ import annotations

import pytest
import torch

from hf_longctx.data.sharding import IGNORE_INDEX, shard_batch
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.training.grpo.loss import GRPOObjective, pack_completions

ONE = SPMesh(dp=1, ring=1, ulysses=1, fpdt_chunks=1, dp_rank=0, ring_rank=0, ulysses_rank=0)
PROMPTS, COMPLETIONS = [[5, 6, 7], [8], [9, 10]], [[11, 12], [], [13, 14, 15]]


@pytest.mark.parametrize("loss_type,weights", [
    ("grpo", [1 / (5 * 2), 1 / (5 * 3)]), ("dr_grpo", [1 / (5 * 16)] * 2), ("dapo", [1 / 9] * 2)])
def test_values_follow_their_targets(loss_type, weights):
    obj = GRPOObjective(loss_type=loss_type, max_completion_length=16)
    packed = pack_completions(PROMPTS, COMPLETIONS, [0.5, -1.0, 2.0], obj, num_sequences=5, num_tokens=9,
                              ref_logps=[[-1.0, -2.0], [], [-3.0, -4.0, -5.0]])
    shard = shard_batch(packed, ONE)
    scored = shard["grpo_weight"][0] > 0
    assert shard["shift_labels"][0][scored].tolist() == [11, 12, 13, 14, 15]  # every completion token, in order
    assert bool((shard["shift_labels"][0][~scored] == IGNORE_INDEX).all())  # prompt tokens and ends are not scored
    assert shard["grpo_advantage"][0][scored].tolist() == [0.5, 0.5, 2.0, 2.0, 2.0]
    assert shard["grpo_ref_logps"][0][scored].tolist() == [-1.0, -2.0, -3.0, -4.0, -5.0]
    assert shard["grpo_doc"][0][scored].tolist() == [1, 1, 3, 3, 3]
    got = shard["grpo_weight"][0][scored].tolist()
    assert got == pytest.approx([weights[0]] * 2 + [weights[1]] * 3)


def test_bad_input_names_the_values():
    obj = GRPOObjective()
    with pytest.raises(ValueError, match=r"lengths \[2, 0\] vs completions \[2, 1\]"):
        pack_completions([[1], [2]], [[3, 4], [5]], [1.0, 2.0], obj, num_sequences=2, num_tokens=3,
                         old_logps=[[0.0, 0.0], []])
    with pytest.raises(ValueError, match="at least one token"):
        pack_completions([[]], [[3]], [1.0], obj, num_sequences=1, num_tokens=1)
    with pytest.raises(ValueError, match="bnpo"):
        GRPOObjective(loss_type="bnpo")


def test_group_advantages_match_trl_scale_rewards_group():
    from trl.trainer.utils import nanstd

    from hf_longctx.training.grpo.step import group_advantages

    r = torch.tensor([1.0, 2.0, 4.0, 4.0, 0.5, 3.0, 2.0, 2.0, 2.0])
    g = r.view(-1, 3)
    trl = ((g - g.nanmean(1, keepdim=True)) / (nanstd(g, dim=1).unsqueeze(1) + 1e-4)).view(-1)  # grpo_trainer.py 2765-2787
    torch.testing.assert_close(group_advantages(r, 3), trl.double(), rtol=1e-6, atol=1e-6)
    assert group_advantages(r, 1).tolist() == [0.0] * 9  # TRL: nan std -> nan_to_num(0)
