"""integrations/unused_params.py, the torch 2.11 stand-in for FSDP2's
`set_reduce_scatter_unused_params`: the hooked unit's output is unchanged, its gradient flows
unchanged, and every parameter the unit manages gets a gradient -- zero where it was unused,
the true one (plus an exact zero) where it was used. (The distributed contract is
tests/distributed/test_moe_unused_experts.py, which takes this path at the floor.)"""

from __future__ import annotations

import torch

from hf_longctx.integrations.unused_params import _attach


class TwoBranches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, x):
        return self.used(x)


def test_unused_parameters_get_zero_gradients_and_used_ones_the_true_gradient():
    torch.manual_seed(0)
    x = torch.randn(5, 4)
    ref = TwoBranches()
    ref(x).square().sum().backward()
    hooked = TwoBranches()
    hooked.load_state_dict(ref.state_dict())
    hooked.register_forward_hook(_attach, prepend=True)
    out = hooked(x)
    torch.testing.assert_close(out, ref(x), rtol=0, atol=0)
    out.square().sum().backward()
    for name in ("used.weight", "used.bias"):
        torch.testing.assert_close(hooked.get_parameter(name).grad, ref.get_parameter(name).grad, rtol=0, atol=0)
    assert ref.unused.weight.grad is None  # the precondition: without the hook, no gradient
    for p in (hooked.unused.weight, hooked.unused.bias):
        assert p.grad is not None and not p.grad.any()
    assert hooked.frozen.grad is None


def test_tuple_and_model_output_are_hooked_on_their_first_grad_tensor():
    from transformers.modeling_outputs import CausalLMOutput

    m = TwoBranches()
    x = torch.randn(2, 4)
    out = _attach(m, (x,), (None, m.used(x), 3))
    assert isinstance(out, tuple) and out[0] is None and out[2] == 3
    out[1].sum().backward()
    assert m.unused.weight.grad is not None
    m.zero_grad(set_to_none=True)
    res = _attach(m, (x,), CausalLMOutput(logits=m.used(x)))
    res.logits.sum().backward()
    assert m.unused.weight.grad is not None and isinstance(res, CausalLMOutput)
