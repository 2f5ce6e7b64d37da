"""The one object the registered attention asks (`integrations/attention_route.py`): each
checkpoint mode's binding answers a call from what it holds or runs it as the mode needs, and
`PatchState.route` is the patch's binding (keeper under checkpoint="attention", split under
checkpoint=True, None without checkpointing)."""

from __future__ import annotations

import pytest
import torch

from hf_longctx.config import PatchOptions
from hf_longctx import init_sequence_parallel
from hf_longctx.integrations.attention_route import AttentionRoute
from hf_longctx.integrations.checkpoint_attention import AttentionKeeper
from hf_longctx.integrations.layer_split import AtAttention, LayerSplit
from hf_longctx.integrations.patch_state import PatchState
from hf_longctx.ops.offload import default_streams


def _state() -> PatchState:
    mesh = init_sequence_parallel()  # one process: no group
    return PatchState(name="t", mesh=mesh, options=PatchOptions.resolve(None, {}, 1, 0), bank=mesh)


def _qkv():
    return torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)


def test_the_patch_state_names_one_route():
    state = _state()
    assert state.route is None
    state.keeper = AttentionKeeper(default_streams())
    assert state.route is state.keeper and isinstance(state.route, AttentionRoute)
    state.keeper, state.split = None, LayerSplit(state)
    assert state.route is state.split and isinstance(state.route, AttentionRoute)


def test_keeper_runs_outside_a_recompute_and_replays_inside():
    keeper, saves = AttentionKeeper(default_streams()), []
    out = torch.randn(1, 4, 2, 8)
    assert keeper.answer(*_qkv()) is None  # no region: the attention runs, nothing kept
    assert keeper.run(lambda save: saves.append(save) or out, lambda: pytest.fail("prepared")) is out
    region = keeper.new_region()
    with keeper.entered(region, recompute=False):
        assert keeper.answer(*_qkv()) is None
        keeper.run(lambda save: out, lambda: ())
    with keeper.entered(region, recompute=True):
        replayed = keeper.answer(*_qkv())  # the kept output, no kernel
    assert saves == [True] and torch.equal(replayed, out) and keeper.replayed == 1


def test_split_captures_in_pre_replays_in_post_and_drops_saves_in_a_first_run():
    split, saves = LayerSplit(_state()), []
    q, k, v = _qkv()
    assert split.answer(q, k, v) is None
    split.mode = "capture"  # pre(rows): the chunk's q, k, v, and the layer stops at its attention
    with pytest.raises(AtAttention):
        split.run(lambda save: pytest.fail("ran in a capture"), lambda: (q, k, v, "call"))
    assert split.captured == (q, k, v, "call")
    split.mode, split.output, split.replays = "replay", torch.ones(1, 4, 2, 8), 0  # post(rows, a)
    assert split.answer(q, k, v) is split.output
    split.mode, split.discarding = None, True  # a checkpoint's first run keeps nothing for a backward
    split.run(lambda save: saves.append(save), lambda: ())
    split.discarding = False
    split.run(lambda save: saves.append(save), lambda: ())
    assert saves == [False, True]
