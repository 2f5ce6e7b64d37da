"""integrations/probe/dry_run.py's comparison scales with the dtype: a one-ULP difference in a bf16 /
fp16 output (another cuBLAS kernel for a shorter shard) is not a leak, a change of a few
percent of the output's scale (what a token-mixing module does to other positions) is, and
fp32 keeps its 1e-4 relative bound."""

from __future__ import annotations

import pytest
import torch

from hf_longctx.integrations.probe.compare import differs as _differs


def _one_ulp_up(t: torch.Tensor, index) -> torch.Tensor:
    bits = t.clone().view(torch.int16)  # bf16 / fp16 are 16-bit: the next representable value is bits + 1
    bits[index] += 1
    return bits.view(t.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_ulp_is_not_a_leak_but_a_few_percent_is(dtype):
    torch.manual_seed(0)
    a = torch.randn(1, 12, 16).to(dtype)
    index = tuple(int(i) for i in (a.abs() == a.abs().max()).nonzero()[0])  # the largest value: the largest ULP
    assert not _differs(a, _one_ulp_up(a, index))
    leak = a.clone()
    leak[0, 3] += 0.05 * a.abs().max()
    assert _differs(a, leak)


def test_fp32_keeps_its_bound():
    a = torch.ones(1, 12, 16)
    assert not _differs(a, a + 5e-5)
    assert _differs(a, a + 2e-4)
