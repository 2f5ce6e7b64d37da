"""The weight-gradient GEMM into its fp32 sum on CUDA (ops/grad_sums.accumulate_mm_): bf16
operands, the fp32 sum as the GEMM's C (`baddbmm(..., out_dtype=float32, out=sum)`), in place.

Tolerance: bf16 products are exact in fp32 and the GEMM accumulates in fp32, so the sum is
within fp32 rounding of a K-term dot product of the float64 result (1e-5 relative over the
tensor); the old path (a bf16 gradient added into the sum) is 2^-8 away."""

import torch

from hf_longctx._compat import gemm_accumulates_in_fp32
from hf_longctx.ops.grad_sums import GradSums, accumulate_mm_, sink_linear


def test_the_gemm_adds_into_the_fp32_sum_in_place():
    assert gemm_accumulates_in_fp32("cuda", torch.bfloat16, torch.float32)
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(384, 256, device="cuda", dtype=torch.bfloat16, generator=g)
    acc = torch.randn(512, 256, device="cuda", generator=g)
    want = acc.double() + a.double() @ b.double()
    ptr = acc.data_ptr()
    accumulate_mm_(acc, a, b)
    assert acc.data_ptr() == ptr
    assert ((acc.double() - want).abs().max() / want.abs().max()).item() < 1e-5
    acc.fill_(float("nan"))
    accumulate_mm_(acc, a, b, fresh=True)  # beta 0: the old values are not read
    assert ((acc.double() - a.double() @ b.double()).abs().max() / want.abs().max()).item() < 1e-5


def test_sink_linear_under_cuda_autocast():
    g = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(96, 64, device="cuda", generator=g, requires_grad=True)
    x = torch.randn(4, 32, 64, device="cuda", generator=g, requires_grad=True)
    dy = torch.randn(4, 32, 96, device="cuda", generator=g)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = torch.nn.functional.linear(x, w)
        want = torch.autograd.grad(ref, [x, w], dy.to(ref.dtype))
        sums = GradSums([w])
        y = sink_linear(x, w, None, sums, 0)
        dx, dw = torch.autograd.grad(y, [x, w], dy.to(y.dtype), allow_unused=True)
    assert dw is None and y.dtype == torch.bfloat16
    got_w = sums.grads(rounded=False)[0]
    for got, ref_g in ((dx, want[0]), (got_w, want[1])):
        assert ((got.double() - ref_g.double()).abs().max() / ref_g.double().abs().max()).item() < 2 ** -7
