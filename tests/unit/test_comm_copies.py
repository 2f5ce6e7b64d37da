"""The Ulysses all-to-all moves every element once: one copy into the send buffer, none when
the layout already is the buffer's, and no `.contiguous()` of what autograd hands back.

The collective itself is replaced by a local stand-in (a group of 2 whose "exchange" returns
the buffer), so what is counted is `distributed/comm.py`'s own copies: aten ops that write
a new tensor from another (cat, clone, copy_, _to_copy) between the caller and the
collective, and after it. Exactness of the routing is tested on gloo (test_comm.py)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_longctx.distributed import comm

COPIES = {"cat", "clone", "copy_", "_to_copy"}


class _Copies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.before, self.after, self.sent = collections.Counter(), collections.Counter(), False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in COPIES:
            (self.after if self.sent else self.before)[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def local_exchange(monkeypatch):
    modes = []

    def exchange(buf, group):
        assert buf.is_contiguous()
        modes[-1].sent = True
        return buf  # what arrives has the buffer's layout

    monkeypatch.setattr(comm, "group_size", lambda group: 2)
    monkeypatch.setattr(comm, "_all_to_all", exchange)
    return modes


def _count(modes, fn, *tensors):
    mode = _Copies()
    modes.append(mode)
    with mode:
        fn(list(tensors), "group")
    return sum(mode.before.values()), sum(mode.after.values())


def test_copies_around_the_all_to_all(local_exchange):
    b, s, h, hkv, d = 1, 8, 4, 2, 16
    head_major = [torch.randn(b, n, s, d).transpose(1, 2) for n in (h, hkv, hkv)]  # what the model hands over
    token_major = [torch.randn(b, 2 * s, n, d) for n in (h // 2, hkv // 2, hkv // 2)]  # the attention's out / grads
    # q, k, v into the send buffer: one cat reading each where it lies; the received views need no copy (B = 1)
    assert _count(local_exchange, comm.seq_to_head, *head_major) == (1, 0)
    # the attention output (token-major): its permuted layout IS the send buffer; one copy after (heads back in place)
    assert _count(local_exchange, comm.head_to_seq, token_major[0]) == (0, 1)
    # the backward's three gradients: one cat, no .contiguous() of each first; after it, a copy only
    # where a tensor's heads must be regrouped (q's 2 heads per rank; k/v have 1)
    assert _count(local_exchange, comm.head_to_seq, *token_major) == (1, 1)
    # the output gradient as autograd hands it (a head-major view): one copy into the buffer
    assert _count(local_exchange, comm.seq_to_head, torch.randn(b, h, s, d).transpose(1, 2)) == (1, 0)


def test_local_attention_backward_hands_dout_over_as_is(monkeypatch):
    from hf_longctx.ops import kernels
    from tests.helpers.reference import make_runs

    seen = []
    real = kernels.varlen_backward

    def spy(dout, *args, **kwargs):
        seen.append(dout.is_contiguous())
        return real(dout, *args, **kwargs)

    monkeypatch.setattr(kernels, "varlen_backward", spy)
    q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
    runs = make_runs([0, 8])
    out = kernels.local_attention(q, k, v, runs, runs, scale=0.25, causal=True)
    (out * torch.randn(1, 8, 2, 16).transpose(1, 2)).sum().backward()  # dout: a head-major view of a token-major grad
    assert seen == [False]  # it reached the backend as it is: no copy on the way
