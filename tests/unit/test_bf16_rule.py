"""The bf16 rule's scalar checks (tests/helpers/bf16_rule.py) pass what they must and catch the
faults they are there for.

`reduction_excess`: a loss summed in fp32 from its per-token terms -- per rank, then over the
ranks, in any order -- is within γₙ·Σ|ℓ|/N of Σℓ/N; the same loss rounded once to bf16, divided
by a count off by one, or missing one rank's share is not. `scalar_excess`: a second draw of the
same small error passes, a lost document (1e-2 relative) does not. `criterion`: two independent
draws of the same noise over 128 entries are within 2x, a doubled noise is not.
"""

from __future__ import annotations

import torch

from tests.helpers.bf16_rule import criterion, reduction_excess, scalar_excess


def _tokens(n: int = 240) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 8  # per-token CE


def test_reduction_holds_for_fp32_sums_in_any_order_and_catches_the_faults():
    tok, ranks = _tokens(), 4
    n = tok.numel()
    shares = [s.float().sum() / n for s in tok.chunk(ranks)]  # each rank's fp32 share of the loss
    loss = torch.stack(shares[::-1]).sum().item()  # the ranks' shares added in fp32, another order
    assert reduction_excess(loss, tok, n, ranks)[0] <= 0
    assert reduction_excess(torch.tensor(loss).bfloat16().item(), tok, n, ranks)[0] > 0  # a bf16 cast of the loss
    assert reduction_excess(tok.sum().item() / (n - 1), tok, n, ranks)[0] > 0  # a normaliser off by one
    assert reduction_excess(loss - shares[0].item(), tok, n, ranks)[0] > 0  # one rank's share lost


def test_scalar_allowance_takes_a_second_draw_and_not_a_lost_document():
    truth = 4.25
    single, ours = truth + 3e-4, truth - 6e-4  # two draws, the second twice the first: the ratio rule's failure
    assert scalar_excess(ours, single, truth)[0] <= 0
    assert scalar_excess(truth * (1 + 1e-2), single, truth)[0] > 0


def test_vector_rule_concentrates_at_128_entries():
    g = torch.Generator().manual_seed(1)
    truth = torch.randn(128, generator=g, dtype=torch.float64)
    noise = lambda scale: truth + scale * 1e-3 * torch.randn(128, generator=g, dtype=torch.float64)  # noqa: E731
    assert all(criterion(truth, noise(1), noise(1))[0] <= 0 for _ in range(50))
    assert criterion(truth, noise(1), noise(3))[0] > 0
