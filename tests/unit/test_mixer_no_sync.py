"""The linear mixers' sequence-parallel ops never make the host wait for the device.

On CUDA a pageable `.to(device)` of a host-built index tensor, or a device tensor indexed
with a host index, is a copy plus a stream synchronisation per mixer layer. Here every op
of `ops/mixers/` (halo convolution, Gated DeltaNet and Mamba-2 head exchange, RG-LRU state
passing) and the RecurrentGemma wrapper of `integrations/mixers/` runs on the META device
-- a device with no data, so a value read (`.item()`, `.tolist()`, `nonzero`) raises --
under a dispatch mode that records every op mixing a host tensor (dim > 0) with a device
tensor, and every host -> device copy that is not `non_blocking`. The collectives are
replaced by shape-correct stand-ins so that every SP rank's index tensors (halo sends,
channel splits, run ends) are exercised on one process. A second forward on the same
batch layout must copy nothing at all: the index tensors are uploaded once per batch.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from hf_longctx.ops.mixers import exchange, rglru
from hf_longctx.ops.mixers.conv import halo_conv
from hf_longctx.ops.mixers.gdn import GDNHeads, gdn_sequence_parallel
from hf_longctx.ops.mixers.layout import SequenceLayout
from hf_longctx.ops.mixers.mamba2 import Mamba2Heads, mamba2_sequence_parallel
from tests.helpers.sync_guard import DEV, HostDeviceGuard, fake_all_to_all_v

CU = (0, 16, 20, 28, 32)  # four documents over ring 2 x ulysses 2: zigzag chunks of 2-4 tokens


@pytest.fixture(autouse=True)
def no_collectives(monkeypatch):
    monkeypatch.setattr(exchange, "all_to_all_v", fake_all_to_all_v)
    monkeypatch.setattr(rglru, "all_to_all_v", fake_all_to_all_v)


def _leaf(*shape):
    return torch.randn(*shape, device=DEV, requires_grad=True)


def _gdn(lay, rank):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    hk, hv, dk, dv, k = 2, 4, 4, 4, 4
    heads = GDNHeads.split(hk, hv, lay.sp)
    conv_dim = 2 * hk * dk + hv * dv
    s = lay.local_length
    return gdn_sequence_parallel(
        _leaf(1, s, conv_dim), _leaf(1, s, hv).sigmoid(), _leaf(1, s, hv), conv_weight=_leaf(conv_dim, k),
        conv_bias=_leaf(conv_dim), activation=F.silu, A_log=_leaf(hv), dt_bias=_leaf(hv), head_k_dim=dk, head_v_dim=dv,
        heads=heads, core=torch_chunk_gated_delta_rule, lay=lay, rank=rank, group="sp",
    )


def _mamba2(lay, rank):
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan

    h, g, p, n, k = 4, 2, 4, 4, 4
    heads = Mamba2Heads.split(h, g, lay.sp)
    conv_dim = h * p + 2 * g * n
    s = lay.local_length
    return mamba2_sequence_parallel(
        _leaf(1, s, conv_dim), _leaf(1, s, h), conv_weight=_leaf(conv_dim, k), conv_bias=None, activation=F.silu,
        A_log=_leaf(h), D=_leaf(h), dt_bias=_leaf(h), dt_limit=(0.0, float("inf")), head_dim=p, state=n, chunk_size=4,
        heads=heads, scan=mamba2_chunk_scan, lay=lay, rank=rank, group="sp",
    )


def _conv(lay, rank, kernel=4):
    return halo_conv(_leaf(1, lay.local_length, 6), lay, _leaf(6, kernel), _leaf(6), rank, "sp")


def _rglru(lay, rank):
    x, a = _leaf(1, lay.local_length, 6), _leaf(1, lay.local_length, 6).sigmoid()
    return rglru.rglru_scan_sequence_parallel(x, a, lay, rank, "sp")


def _recurrent_block(lay, rank):
    """The RecurrentGemma wrapper (`integrations/mixers/wrappers.recurrent_block`): conv, gates with
    the document-start reset, scan, gating."""
    import transformers as tf
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRecurrentBlock

    from hf_longctx.integrations.mixers.wrappers import recurrent_block

    cfg = tf.RecurrentGemmaConfig(hidden_size=16, lru_width=16, num_attention_heads=2, conv1d_width=4, vocab_size=32)
    with torch.device(DEV):
        module = RecurrentGemmaRecurrentBlock(cfg, 0)
    bind = types.SimpleNamespace(layout=lambda m, h: lay, rank=rank, group="sp")
    out, _ = recurrent_block(module, bind)(_leaf(1, lay.local_length, 16))
    return out


OPS = {"conv": _conv, "gdn": _gdn, "mamba2": _mamba2, "rglru": _rglru, "recurrent_block": _recurrent_block}


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("ring,ulysses", [(2, 2), (1, 1)])
def test_mixer_ops_never_synchronise(op, ring, ulysses):
    lay = SequenceLayout(CU, ring, ulysses)
    for rank in range(lay.sp):
        guard = HostDeviceGuard()
        with guard:
            out = OPS[op](lay, rank)
            out.float().sum().backward()
        assert guard.syncs == [], f"{op}, rank {rank}: {guard.syncs}"
        again = HostDeviceGuard()
        with again:
            OPS[op](lay, rank).float().sum().backward()
        assert again.syncs == [] and again.uploads == 0, f"{op}, rank {rank}: the second layer copied {again.uploads}"


def test_the_guard_sees_each_kind_of_sync():
    """The guard above is only worth its zeros if it sees the faults it looks for."""
    idx = torch.arange(3)
    x = torch.randn(4, 5, device=DEV)
    faults = {
        "pageable upload": lambda: idx.to(DEV),
        "host index on a device tensor": lambda: x.index_select(1, idx),
        "advanced indexing with a host index": lambda: x[:, idx],
    }
    for name, fault in faults.items():
        guard = HostDeviceGuard()
        with guard:
            fault()
        assert guard.syncs, name
    with pytest.raises(Exception):  # a value read of a device tensor cannot even run on meta
        x.sum().item()
    guard = HostDeviceGuard()
    with guard:
        x.index_select(1, idx.to(DEV, non_blocking=True))
    assert guard.syncs == [] and guard.uploads == 1
