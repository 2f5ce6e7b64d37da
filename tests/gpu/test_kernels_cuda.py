"""The fast CUDA kernels (flash-attn 2.x, torch's flash ops) against the math kernel, forward
and backward: bf16 and fp16, windows, softcap, GQA, packed documents, zigzag ring layouts.

Tolerance: both paths accumulate in fp32 and round once to the 16-bit dtype (bf16 eps
2^-8, fp16 2^-11); relative error 2e-2 (bf16) / 4e-3 (fp16) over the whole tensor is a few
eps, while a wrong mask or alignment changes whole rows (O(1))."""

import pytest
import torch

from hf_longctx.layout import ring_stream, runs_to_indices
from hf_longctx.ops import kernels
from hf_longctx.ops.backends import select
from hf_longctx.ops.backends.packed import PackedBackend
from tests.helpers.reference import make_runs, rel_err

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _fast_backends():
    if not torch.cuda.is_available():
        return []
    env = select.probe_env(torch.device("cuda"))
    return [PackedBackend(n, k) for n, k in (("flash_attn", env.flash_attn), ("torch_flash", env.torch_flash)) if k is not None]


def _layouts(s):
    cu = [0, s // 2, s // 2 + s // 8, s]
    return {"packed": (make_runs(cu), make_runs(cu)),
            "zigzag": (ring_stream(cu, 2, 1), ring_stream(cu, 2, 0) + ring_stream(cu, 2, 1))}


def test_dispatch_picks_a_fast_kernel():
    q = torch.zeros(1, 8, 64, 64, device="cuda", dtype=torch.bfloat16)
    assert kernels.backend_for(q, softcap=None).name != "math", "no fast CUDA kernel: install flash-attn or a torch with flash"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["packed", "zigzag"])
@pytest.mark.parametrize("causal,window,softcap,hkv", [
    (True, None, None, 8), (True, None, None, 2), (False, None, None, 2), (True, 256, None, 2), (False, 128, None, 8),
    (True, None, 30.0, 2), (True, 256, 30.0, 2),
])
def test_fast_kernel_matches_math(dtype, layout, causal, window, softcap, hkv):
    backends = [b for b in _fast_backends() if softcap is None or b.name == "flash_attn"]
    if not backends:
        pytest.skip("no fast kernel for this case here")
    s, h, d = 2048, 8, 128
    q_runs, k_runs = _layouts(s)[layout]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(1, h, len(runs_to_indices(q_runs)), d, device="cuda", generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(1, hkv, len(runs_to_indices(k_runs)), d, device="cuda", generator=g, dtype=dtype) for _ in range(2))
    kw = dict(scale=d**-0.5, causal=causal, window=window, softcap=softcap)
    m_out, m_lse = kernels.varlen_forward(q, k, v, q_runs, k_runs, backend=select.MATH, **kw)
    m_grads = kernels.varlen_backward(do, q, k, v, m_out, m_lse, q_runs, k_runs, backend=select.MATH, grad_dtype=torch.float32, **kw)
    for backend in backends:
        out, lse = kernels.varlen_forward(q, k, v, q_runs, k_runs, backend=backend, **kw)
        grads = kernels.varlen_backward(do, q, k, v, out, lse, q_runs, k_runs, backend=backend, **kw)
        assert rel_err(out.float(), m_out.float()) < TOL[dtype], backend.name
        torch.testing.assert_close(lse, m_lse, rtol=1e-3, atol=1e-3)
        for name, g_, m in zip("qkv", grads, m_grads):
            assert rel_err(g_.float(), m) < 2 * TOL[dtype], (backend.name, name)


@pytest.mark.parametrize("layout", ["packed", "zigzag"])
def test_deterministic_backward_is_bitwise_reproducible(layout):
    """Under torch.use_deterministic_algorithms(True) the fast kernels' backward (flash-attn told
    `deterministic=True`, torch's op reading the flag) gives the same bits twice."""
    backends = _fast_backends()
    if not backends:
        pytest.skip("no fast kernel for this case here")
    s, h, d = 2048, 8, 128
    q_runs, k_runs = _layouts(s)[layout]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(1, h, len(runs_to_indices(q_runs)), d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, 2, len(runs_to_indices(k_runs)), d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    kw = dict(scale=d**-0.5, causal=True, window=None, softcap=None)
    torch.use_deterministic_algorithms(True)
    try:
        for backend in backends:
            out, lse = kernels.varlen_forward(q, k, v, q_runs, k_runs, backend=backend, **kw)
            first, second = (kernels.varlen_backward(do, q, k, v, out, lse, q_runs, k_runs, backend=backend, **kw)
                             for _ in range(2))
            assert all(torch.equal(a, b) for a, b in zip(first, second)), backend.name
    finally:
        torch.use_deterministic_algorithms(False)


def test_in_place_merge_reads_a_bf16_block_on_cuda():
    from hf_longctx.ops.lse import merge, merge_

    g = torch.Generator(device="cuda").manual_seed(0)
    acc = torch.randn(1, 8, 4096, 128, device="cuda", generator=g)
    block = torch.randn(1, 8, 4096, 128, device="cuda", generator=g).to(torch.bfloat16)
    lse, block_lse = (torch.randn(1, 8, 4096, device="cuda", generator=g) for _ in range(2))
    ref, ref_lse = merge(acc, lse, block.float(), block_lse)
    out, new_lse = merge_(acc.clone(), lse, block, block_lse)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(new_lse, ref_lse)
