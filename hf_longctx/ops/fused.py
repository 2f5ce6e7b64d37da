"""The elementwise work between two GEMMs as pure functions, for `patch(fused=True)` to compile.

Where it sits: `integrations/fusion.py` compiles these with `torch.compile` (inductor: one
generated kernel per region, forward and backward, where eager runs one kernel per op) and
routes the gated MLPs of Llama's form (`gated_product`) and the chunked LM head's loss
(`ops/chunked_loss.py`: `cross_entropy_tail`) through them; the norms and the attention
modules' RoPE regions are the model's own code, compiled as they are. Guarantees: the math of
the eager ops each replaces, per token, evaluated in fp32 and rounded once to the compute dtype
where eager rounds after every op, so fp32 results agree up to summation order and bf16 ones
within bf16's own error (tests/distributed/test_fused.py). No collective, no Python state, no
graph break: each compiles to one graph.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def gated_product(act: nn.Module, gate: Tensor, up: Tensor) -> Tensor:
    """act(gate) * up, the product between a gated MLP's up and down projections (SwiGLU with
    SiLU): [..., I] from two [..., I]."""
    return act(gate) * up


def cross_entropy_tail(logits: Tensor, targets: Tensor, scale: Tensor, softcap: float | None,
                       ignore_index: int) -> tuple[Tensor, Tensor]:
    """(Σ of the rows' cross-entropies, fp32 [], and its gradient w.r.t. `logits` times
    `scale`, in the logits' dtype [n, V]) of one chunk's logits [n, V] and targets [n].

    What ForCausalLMLoss computes on `softcap(logits).float()` (Gemma2's tanh softcap when
    `softcap` is set) and what its backward returns, in one pass: a row's loss is
    logsumexp(z) - z[t], its gradient (softmax(z) - onehot(t)) · scale (· the softcap's
    derivative 1 - tanh²), 0 for a row whose target is `ignore_index`. `scale` is a 0-d fp32
    tensor (1 / the loss's denominator): a tensor, so a new denominator is no new graph."""
    z = logits.float()  # [n, V]
    squash = None
    if softcap is not None:
        squash = torch.tanh(z / softcap)
        z = squash * softcap
    valid = targets != ignore_index  # [n]
    safe = torch.where(valid, targets, 0)  # [n]: a valid index where the row is ignored
    lse = torch.logsumexp(z, dim=-1)  # [n]
    picked = z.gather(1, safe[:, None])[:, 0]  # [n, 1] -> [n]
    loss = torch.where(valid, lse - picked, 0.0).sum()
    onehot = torch.arange(z.shape[1], device=z.device)[None, :] == safe[:, None]  # [n, V]
    grad = (torch.exp(z - lse[:, None]) - onehot.float()) * torch.where(valid, scale, 0.0)[:, None]  # [n, V]
    if squash is not None:
        grad = grad * (1.0 - squash * squash)
    return loss, grad.to(logits.dtype)
