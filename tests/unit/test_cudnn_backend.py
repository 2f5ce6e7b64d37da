"""cuDNN attention through torch's ops and through cudnn-frontend, against CPU emulations.

What fails here: an argument of `aten::_cudnn_attention_forward/_backward` or `cudnn::sdpa_fwd/
_bwd` out of its schema's order or name; the LSE read in the wrong layout or units; a causal
call with a rectangular sequence sent to the top-left kernel; a strided or misaligned operand
handed to torch's varlen path; the band of cudnn-frontend off by one; a refusal that does not
fall back to the next exact backend or a named backend run where it cannot be exact.
Exactness in float64 through the emulations (relative error 1e-10, as test_backends.py).
"""

import inspect
import warnings

import pytest
import torch

from hf_longctx.ops.backends import cudnn, cudnn_frontend, select
from hf_longctx.ops.backends.packed import PackedBackend
from hf_longctx.ops.backends.sequences import Seq
from hf_longctx.ops.backends.square_causal import square_pieces
from tests.helpers.backend_cases import packed_errors
from tests.helpers.emulated_backends import cuda_env
from tests.helpers.emulated_cudnn import CudnnOps
from tests.helpers.emulated_cudnn_frontend import BWD_SCHEMA, FWD_SCHEMA, frontend_ops

F64 = 1e-10
LAYOUTS = ["packed", "zigzag", "random"]


def _cudnn(lse_layout="H,T"):
    ops = CudnnOps(lse_layout=lse_layout, allow_float64=True)
    return PackedBackend("cudnn", cudnn.CudnnKernel(ops.forward, ops.backward)), ops


def _frontend():
    ops, sim = frontend_ops(allow_float64=True)
    return PackedBackend("cudnn_frontend", cudnn_frontend.CudnnFrontendKernel(ops)), sim


# ---- the contracts read from the installed torch and from the wheel -------------------------

def test_emulation_has_the_installed_schemas():
    """The emulated aten ops' Python signatures are the installed torch's schemas (names, order,
    keyword-only), and the adapter's detection accepts those real schemas."""
    emu = CudnnOps()
    for fn, op in ((emu.forward, torch.ops.aten._cudnn_attention_forward),
                   (emu.backward, torch.ops.aten._cudnn_attention_backward)):
        params = list(inspect.signature(fn).parameters.values())
        args = op.default._schema.arguments
        assert [p.name for p in params] == [a.name for a in args]
        assert [p.kind == p.KEYWORD_ONLY for p in params] == [a.kwarg_only for a in args]
    real = (torch.ops.aten._cudnn_attention_forward, torch.ops.aten._cudnn_attention_backward)
    assert cudnn.detect(*real, 91400) is None


def _schema_op(text):
    parsed = torch._C.parse_schema(text)
    return type("Op", (), {"default": type("D", (), {"_schema": parsed})})


def test_detect_refuses_a_schema_in_another_order():
    """A torch whose backward takes philox seed/offset after `is_causal` (flash's order, what
    torch 2.13's own varlen.py passes) is refused, not called."""
    fwd = torch.ops.aten._cudnn_attention_forward
    swapped = _schema_op(
        "aten::_cudnn_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
        "Tensor logsumexp, Tensor attn_bias, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, "
        "float dropout_p, bool is_causal, Tensor philox_seed, Tensor philox_offset, *, float? scale=None) -> (Tensor, Tensor, Tensor)"
    )
    why = cudnn.detect(fwd, swapped, 91400)
    assert why is not None and "philox_seed" in why


@pytest.mark.parametrize("version,why", [(None, "no cuDNN"), (91300, "9.13.0 is older than 9.14.0"), (90100, "9.1.0")])
def test_detect_refuses_old_or_missing_cudnn(version, why):
    real = (torch.ops.aten._cudnn_attention_forward, torch.ops.aten._cudnn_attention_backward)
    assert why in cudnn.detect(*real, version)
    assert "switched off" in cudnn.detect(*real, 91400, sdp_enabled=False)


def test_frontend_emulation_binds_like_the_wheel_schema():
    """The adapter's calls bind to cudnn-frontend 1.32's schemas (the emulation refuses any
    other name or an extra positional), and detection reads them."""
    ops, _ = frontend_ops()
    assert str(ops.sdpa_fwd.default._schema) == str(torch._C.parse_schema(FWD_SCHEMA))
    assert str(ops.sdpa_bwd.default._schema) == str(torch._C.parse_schema(BWD_SCHEMA))
    assert cudnn_frontend.detect("1.32.0", ops) is None
    assert "not installed" in cudnn_frontend.detect(None, None)
    with pytest.raises(TypeError):
        ops.sdpa_fwd(*([None] * 17))


@pytest.mark.parametrize("lse_layout", ["H,T", "T,H,1"])
def test_lse_is_natural_log_in_both_layouts(lse_layout):
    """One document: the adapter's lse [H, T] is the natural-log logsumexp of the scaled scores
    whatever layout the installed torch returns, and its backward hands that layout back."""
    backend, ops = _cudnn(lse_layout)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 12], dtype=torch.int32)
    out, lse = backend.kernel.forward(q, k, v, cu, cu, 12, 12, scale=0.3, causal=False, left=-1, right=-1, softcap=None)
    scores = torch.einsum("qhd,khd->hqk", q, k) * 0.3
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)
    assert backend.kernel.seen["lse"] == lse_layout and lse.shape == (2, 12)
    dq, _, _ = backend.kernel.backward(torch.ones_like(out), q, k, v, out, lse, cu, cu, 12, 12, scale=0.3, causal=False,
                                       left=-1, right=-1, softcap=None)
    assert dq.shape == q.shape


def test_backward_before_forward_is_refused():
    backend, _ = _cudnn()
    x = torch.zeros(4, 2, 8, dtype=torch.float64)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="LSE layout"):
        backend.kernel.backward(x, x, x, x, x, torch.zeros(2, 4), cu, cu, 4, 4, scale=1.0, causal=True, left=-1,
                                right=-1, softcap=None)


# ---- top-left causal: every causal call square ---------------------------------------------

def _dense(seq: Seq, top_left: bool) -> set:
    """(row, key position) pairs a sequence allows, bottom-right (flash) or top-left (cuDNN)."""
    keys = [j for a, b in seq.k for j in range(a, b)]
    nq, nk = seq.q[1] - seq.q[0], len(keys)
    shift = 0 if top_left else nk - nq
    out = set()
    for i in range(nq):
        for c in range(nk):
            if (seq.right < 0 or c <= i + shift + seq.right) and (seq.left < 0 or c >= i + shift - seq.left):
                out.add((seq.q[0] + i, keys[c]))
    return out


@pytest.mark.parametrize("nq,nk,right", [(5, 9, 0), (9, 5, 0), (6, 6, 0), (4, 10, 2), (7, 3, 1), (8, 2, 0), (3, 3, 5),
                                         (1, 7, 0), (7, 1, 0)])
def test_square_pieces_compute_the_bottom_right_band(nq, nk, right):
    """A bottom-right band (-1, r) over a rectangle equals the union of its pieces read top-left,
    every causal piece square, no pair twice."""
    seq = Seq((0, nq), (0, nq), ((100, 100 + nk - 2), (200, 202)) if nk > 2 else ((100, 100 + nk),), -1, right)
    pieces = square_pieces(seq)
    pairs = [_dense(p, top_left=True) for p in pieces]
    assert set().union(*pairs) == _dense(seq, top_left=False)
    assert sum(map(len, pairs)) == len(_dense(seq, top_left=False))
    for p in pieces:
        assert (p.left, p.right) in ((-1, -1), (-1, 0))
        if p.right == 0:
            assert p.q[1] - p.q[0] == sum(b - a for a, b in p.k)


def test_square_pieces_refuse_a_window():
    with pytest.raises(ValueError, match="sliding window"):
        square_pieces(Seq((0, 4), (0, 4), ((0, 4),), 2, 0))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_rectangular_causal_call_is_caught(layout):
    """The check has teeth: the same kernel planned bottom-right (as the flash kernels are) sends
    rectangular causal sequences, which the top-left emulation computes wrong; planned square it
    sends none and is exact."""
    backend, ops = _cudnn()
    assert max(packed_errors(backend, layout, True, None, None).values()) < F64
    assert ops.rectangular_causal == 0
    if layout == "packed":
        return  # packed documents are square already
    kernel = backend.kernel

    class BottomRight:  # the flash kernels' planning: bands passed as causal, rectangles left as they are
        def forward(self, *a, left, right, **kw):
            return kernel.forward(*a, left=-1, right=-1, **kw)

        def backward(self, *a, left, right, **kw):
            return kernel.backward(*a, left=-1, right=-1, **kw)

    errors = packed_errors(PackedBackend("bottom-right", BottomRight()), layout, True, None, None)
    assert ops.rectangular_causal > 0 and max(errors.values()) > 1e-3


# ---- exactness through the emulations, float64 ----------------------------------------------

@pytest.mark.parametrize("lse_layout", ["H,T", "T,H,1"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (4, 1)])
def test_cudnn_backend_matches_reference(lse_layout, layout, causal, heads):
    """Forward, lse and backward through the emulated aten ops equal the float64 reference,
    GQA included, the keys of the backward in two pieces."""
    backend, ops = _cudnn(lse_layout)
    errors = packed_errors(backend, layout, causal, None, None, heads=heads)
    assert max(errors.values()) < F64, errors
    assert ops.rectangular_causal == 0


FRONTEND_MODES = [(True, None), (False, None), (True, 5), (False, 3), (True, 2)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal,window", FRONTEND_MODES)
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)])
def test_frontend_backend_matches_reference(layout, causal, window, heads):
    """cudnn-frontend, windows included: bottom-right bands as flash-attn's, the left bound one
    more than flash-attn's left, the padded LSE of the backward."""
    backend, _ = _frontend()
    errors = packed_errors(backend, layout, causal, window, None, heads=heads)
    assert max(errors.values()) < F64, errors


def test_frontend_band_off_by_one_is_caught():
    """The check has teeth: flash-attn's left bound handed over unchanged misses one key per row."""
    backend, _ = _frontend()
    good = cudnn_frontend.band

    def off_by_one(causal, left, right):
        kw = good(causal, left, right)
        kw["window_left"] = left if left >= 0 else -1
        return kw

    cudnn_frontend.band = off_by_one
    try:
        errors = packed_errors(backend, "packed", True, 5, None)
    except ValueError as exc:  # a left bound of 0 is refused by the op itself: caught too
        errors = {"refused": float("inf")}
        assert "sliding-window length" in str(exc)
    finally:
        cudnn_frontend.band = good
    assert max(errors.values()) > 1e-3


def test_padded_lse_places_each_token():
    lse = torch.arange(2 * 7, dtype=torch.float32).reshape(2, 7)  # [H, T]
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    padded = cudnn_frontend.padded_lse(lse, cu, 4)
    assert padded.shape == (2, 2, 4, 1)
    assert padded[0, 0, :3, 0].tolist() == [0, 1, 2] and padded[0, 0, 3, 0] == 0  # sequence 0, head 0
    assert padded[1, 1, :, 0].tolist() == [10, 11, 12, 13]  # sequence 1, head 1: tokens 3..6


# ---- layouts cuDNN's varlen path reads wrong: copied, and counted ---------------------------

def test_strided_and_misaligned_operands_are_copied_and_counted():
    """q/k/v as views of one buffer (what the Ulysses all-to-all hands over) and a view starting
    off a 16-byte boundary: the adapter copies them (counted) and stays exact; handed to the op
    as they are, the older sources' addressing reads the wrong rows or faults."""
    backend, ops = _cudnn()
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(20, 3, 2, 8, generator=g, dtype=torch.float64)  # [T, (q, k, v), H, D]
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]  # strided [T, H, D] views
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    kw = dict(scale=0.3, causal=True, left=-1, right=-1, softcap=None)
    out, lse = backend.kernel.forward(q, k, v, cu, cu, 13, 13, **kw)
    ref_out, ref_lse = backend.kernel.forward(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, 13, 13, **kw)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    assert backend.kernel.copies == {"q": 1, "k": 1, "v": 1}
    raw = ops.forward(q, k, v, None, cu, cu, 13, 13, True, 0.0, True, False, scale=0.3)[0]
    assert (raw - ref_out).abs().max() > 1e-3  # what a caller without the copy would get
    flat = torch.randn(20 * 16 + 1, dtype=torch.float64)
    shifted = flat[1:].view(20, 2, 8)  # contiguous, 8 bytes off the allocation's alignment
    with pytest.raises(RuntimeError, match="misaligned"):
        ops.forward(shifted, shifted, shifted, None, cu, cu, 13, 13, True, 0.0, True, False, scale=0.3)
    backend.kernel.forward(shifted, shifted, shifted, cu, cu, 13, 13, **kw)
    assert backend.kernel.copies["q"] == 2


# ---- refusals and fallbacks -----------------------------------------------------------------

def _select(env, **kw):
    base = dict(dtype=torch.bfloat16, head_dim=128, softcap=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return select.select_backend(env, **{**base, **kw})


@pytest.mark.parametrize("case,why,fallback", [
    (dict(window=64), "no sliding window", "torch_flash"),
    (dict(softcap=30.0), "no logit softcap", "flash_attn"),
    (dict(head_dim=256), "<= 128", "torch_flash"),
    (dict(dtype=torch.float32), "not float32", None),
])
def test_cudnn_refusals_fall_back_to_the_next_exact_backend(case, why, fallback):
    """Measured fastest but not exact for the call: the next exact backend of the ranking runs;
    named, the call is refused with the reason."""
    env, _ = cuda_env(flash="2.8.3", cudnn="H,T")
    if fallback is not None:
        measured = select.AttentionChoice(ranking=("cudnn", "torch_flash", "flash_attn"))
        assert _select(env, choice=measured, **case).name == fallback
    with pytest.raises(ValueError, match=why):
        _select(env, choice=select.AttentionChoice(named="cudnn"), **case)


def test_too_old_cudnn_is_refused_with_the_version():
    env, _ = cuda_env(flash=None, cudnn="H,T", cudnn_version=91300)
    assert _select(env, choice=select.AttentionChoice(ranking=("cudnn", "torch_flash"))).name == "torch_flash"
    with pytest.raises(ValueError, match=r"cuDNN 9\.13\.0 is older than 9\.14\.0"):
        _select(env, choice=select.AttentionChoice(named="cudnn"))


def test_named_backends_are_honoured_or_refused():
    env, _ = cuda_env(flash="2.8.3", cudnn="H,T", frontend=True)
    for name in ("cudnn", "cudnn_frontend", "flash_attn", "torch_flash"):
        assert _select(env, choice=select.AttentionChoice(named=name)).name == name
    assert _select(env, choice=select.AttentionChoice(named="cudnn_frontend"), window=64).name == "cudnn_frontend"
    with pytest.raises(ValueError, match=r"activate_flash_attention_impl\('FA3'\)"):
        _select(env, choice=select.AttentionChoice(named="torch_flash[FA3]"))
    fa3, _ = cuda_env(flash=None, torch_impl="FA3")
    assert _select(fa3, choice=select.AttentionChoice(named="torch_flash[FA3]")).name == "torch_flash[FA3]"
    with pytest.raises(ValueError, match="restore_flash_attention_impl"):
        _select(fa3, choice=select.AttentionChoice(named="torch_flash"))
    ampere, _ = cuda_env(flash="2.8.3", torch_impl="FA3", capability=(8, 0))
    assert _select(ampere).name == "flash_attn"  # torch's FA3 cannot run on sm80: the next exact kernel
    with pytest.raises(ValueError, match=r"runs on compute capability 9\.0, not 8\.0"):
        _select(ampere, choice=select.AttentionChoice(named="torch_flash[FA3]"))
    cpu = select.KernelEnv("cpu", cpu_op=True)
    with pytest.raises(ValueError, match="runs on CUDA"):
        _select(cpu, choice=select.AttentionChoice(named="cudnn"))


def test_unmeasured_cudnn_is_never_picked_automatically():
    """Installed and exact, but with no measured fraction on this GPU: torch's flash ops run."""
    env, _ = cuda_env(flash=None, cudnn="H,T", frontend=True)
    assert _select(env).name == "torch_flash"
    assert _select(env, choice=select.AttentionChoice(ranking=("torch_flash",))).name == "torch_flash"
    assert _select(env, choice=select.AttentionChoice(ranking=("cudnn_frontend", "torch_flash"))).name == "cudnn_frontend"
