"""ops/grad_sums.py: row chunks' parameter gradients summed in place, and the property it buys.

The GEMM into the sum (`accumulate_mm_`) is checked against `a @ b` in float64 (fp32 operands:
1e-6 relative, the fp32 rounding of a K=64 dot product; bf16 operands widened: exact products,
so the same bound); `SinkLinear` against `F.linear` under autograd (input, bias and weight
gradients, two chunks summing to the whole, fp32 at 1e-6 and under CPU bf16 autocast at the bf16
rule of one rounding, 2^-8). The property (benchmarks/row_chunks.py's counter): in a step of
memory="max" or "balanced" knobs, the fresh parameter-shaped tensors and the add kernels on them
do not grow with the number of row chunks (u = 2 and 8). Put the old path back (the chunk
gradients summed by `add_`) and the adds appear and grow with u: 15 at u=2, 105 at u=8.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_longctx.ops.grad_sums import GradSums, SumsSlot, accumulate_mm_, sink_linear

torch.set_num_threads(1)


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def test_the_gemm_writes_into_the_sum():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 64, generator=g), torch.randn(64, 24, generator=g)
    acc = torch.randn(16, 24, generator=g)
    want = acc.double() + a.double() @ b.double()
    ptr = acc.data_ptr()
    accumulate_mm_(acc, a, b)
    assert acc.data_ptr() == ptr and _rel(acc, want) < 1e-6
    acc.fill_(float("nan"))  # fresh: the old values are not read
    accumulate_mm_(acc, a, b, fresh=True)
    assert _rel(acc, a.double() @ b.double()) < 1e-6
    a16, b16 = a.bfloat16(), b.bfloat16()  # bf16 operands into an fp32 sum (CPU: widened chunk operands)
    accumulate_mm_(acc, a16, b16, fresh=True)
    assert acc.dtype == torch.float32 and _rel(acc, a16.double() @ b16.double()) < 1e-6


def _linear_case(dtype=torch.float32, autocast=False):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(12, 8, generator=g, dtype=dtype, requires_grad=True)
    bias = torch.randn(12, generator=g, dtype=dtype, requires_grad=True)
    x = torch.randn(2, 10, 8, generator=g, dtype=dtype, requires_grad=True)
    dy = torch.randn(2, 10, 12, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ref = F.linear(x, w, bias)
        want = torch.autograd.grad(ref, [x, bias, w], dy.to(ref.dtype))
        sums = GradSums([w])
        got_x, got_b, got_y = [], [], []
        for rows in (slice(0, 4), slice(4, 10)):  # two row chunks
            xc = x[:, rows].detach().requires_grad_()
            y = sink_linear(xc, w, bias, sums, 0)
            dx, db, dw = torch.autograd.grad(y, [xc, bias, w], dy[:, rows].to(y.dtype), allow_unused=True)
            assert dw is None  # the weight's gradient went into the sum
            got_x.append(dx), got_b.append(db), got_y.append(y)
    return ref, want, torch.cat(got_y, 1), (torch.cat(got_x, 1), sum(got_b), sums.grads(rounded=False)[0])


def test_sink_linear_equals_linear_under_autograd():
    ref, want, y, got = _linear_case()
    assert _rel(y, ref) < 1e-6  # the same F.linear, on row chunks (another GEMM blocking)
    for a, b in zip(got, want):
        assert _rel(a, b) < 1e-6


def test_sink_linear_under_autocast_casts_like_autocast():
    ref, want, y, got = _linear_case(autocast=True)
    assert y.dtype == ref.dtype == torch.bfloat16
    assert _rel(y, ref) < 2 ** -8
    assert got[0].dtype == torch.float32 and got[2].dtype == torch.float32
    for a, b in zip(got, want):
        assert _rel(a, b) < 2 ** -8  # bf16: one rounding of the reference's per-GEMM result


def test_the_slot_binds_one_backward_at_a_time():
    slot, outer, inner = SumsSlot(), GradSums([]), GradSums([])
    with slot.bound(outer):
        with slot.bound(inner):
            assert slot.active is inner
        assert slot.active is outer
    assert slot.active is None


def test_parameter_gradient_traffic_does_not_grow_with_row_chunks():
    from benchmarks.row_chunks import step_traffic

    for mode in ("max", "balanced"):
        two, eight = step_traffic(mode, 2, 2), step_traffic(mode, 8, 2)
        assert two["adds"] == eight["adds"] == 0, (mode, two, eight)
        assert two["fresh"] == eight["fresh"] and two["fresh_bytes"] == eight["fresh_bytes"], (mode, two, eight)
