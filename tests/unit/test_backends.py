"""ops/backends against CPU emulations of each external kernel API (tests/helpers/emulated_backends.py).

What fails here: a wrong argument name or order, a wrong window / causal alignment
conversion, a wrong lse layout, a lost GQA or softcap, a tile sent to the math kernel
when a fast kernel could take it, more than one varlen call for a packed micro-batch.
Exactness tests run the emulations in float64 (relative error 1e-10, as
tests/unit/test_kernels.py: only reassociation separates the paths); the dispatch tests
run bf16 as the real kernels require.
"""

import inspect
import warnings
from pathlib import Path

import pytest
import torch

from hf_longctx.layout import runs_to_indices
from hf_longctx.ops import kernels
from hf_longctx.ops.backends import CAPABILITIES, markdown_table, select
from hf_longctx.ops.backends import flash_attn as fa_adapter
from hf_longctx.ops.backends.packed import PackedBackend
from hf_longctx.ops.backends.tiled import TiledBackend
from tests.helpers.backend_cases import D, packed_errors, tensors
from tests.helpers.backend_cases import layout as layout_of
from tests.helpers.emulated_backends import TorchFlashOps, cuda_env, flash_attn_release
from tests.helpers.reference import make_runs, rel_err

F64 = 1e-10
RELEASES = ["2.6.3", "2.7.0", "2.7.4.post1", "2.8.3"]


# ---- detection -------------------------------------------------------------------------

@pytest.mark.parametrize("version", RELEASES + ["2.6.0", "2.6.0.post1", "2.6.1", "2.7.2"])
def test_detects_every_supported_release(version):
    v, iface, ops, _ = flash_attn_release(version)
    api, reason = fa_adapter.detect(v, iface, ops)
    assert reason is None and api.window_tuple == (version < "2.7")
    if version >= "2.7":  # custom ops: the Python signature says nothing, the schema does
        assert list(inspect.signature(iface._flash_attn_varlen_forward).parameters) == ["args", "kwargs"]


@pytest.mark.parametrize("version,why", [("2.5.9", "outside"), ("3.0.0", "outside"), (None, "no __version__")])
def test_refuses_unsupported_releases(version, why):
    _, iface, ops, _ = flash_attn_release("2.8.3")
    api, reason = fa_adapter.detect(version, iface, ops)
    assert api is None and why in reason


def test_refuses_a_custom_op_whose_schema_lacks_windows():
    v, iface, ops, _ = flash_attn_release("2.7.4", schema_without_window=True)
    api, reason = fa_adapter.detect(v, iface, ops)
    assert api is None and "window_size_left" in reason


def test_torch_emulation_has_the_installed_schemas():
    """The torch emulation's Python signature is the real aten schema (names, order, kw-only)."""
    emu = TorchFlashOps()
    for fn, op in ((emu.forward, torch.ops.aten._flash_attention_forward), (emu.backward, torch.ops.aten._flash_attention_backward)):
        params = list(inspect.signature(fn).parameters.values())
        args = op.default._schema.arguments
        assert [p.name for p in params] == [a.name for a in args]
        assert [p.kind == p.KEYWORD_ONLY for p in params] == [a.kwarg_only for a in args]


# ---- exact wiring, float64 -------------------------------------------------------------

def _backend(kind):
    env, sims = cuda_env(flash=None if kind == "torch" else kind, allow_float64=True)
    kernel = env.torch_flash if kind == "torch" else env.flash_attn
    return PackedBackend(kind, kernel), sims["torch_flash" if kind == "torch" else "flash_attn"]


MODES = [(True, None, None), (False, None, None), (True, 5, None), (False, 3, None), (True, None, 2.0), (True, 6, 1.5)]


@pytest.mark.parametrize("kind", ["2.6.0", "2.6.3", "2.7.0", "2.8.3", "torch"])
@pytest.mark.parametrize("layout", ["packed", "zigzag", "random"])
@pytest.mark.parametrize("causal,window,softcap", MODES)
def test_packed_backend_matchesreference(kind, layout, causal, window, softcap):
    """Forward, lse and backward through each emulated API equal the dense float64
    reference, also when the keys are split in two and the pieces merged / summed."""
    if kind == "torch" and softcap is not None:
        pytest.skip("torch's flash kernels have no softcap (the dispatcher never sends it there)")
    backend, sim = _backend(kind)
    errors = packed_errors(backend, layout, causal, window, softcap)
    assert max(errors.values()) < F64, errors
    if layout == "packed" and window is None:  # one document per sequence, one call each way
        assert sim.calls == {"forward": 1, "backward": 2}  # backward: once per key half


@pytest.mark.parametrize("version", ["2.6.0", "2.6.0.post1", "2.6.1", "2.6.2"])
def test_every_2_6_signature_is_called_correctly(version):
    """v2.6.0 / 2.6.0.post1 take `block_table` positionally with no default (optional from
    v2.6.1) and know no `leftpad_k` / `seqused_k`: the adapter's call binds in each."""
    v, iface, ops, sim = flash_attn_release(version)
    api, reason = fa_adapter.detect(v, iface, ops)
    assert reason is None
    kernel = fa_adapter.FlashAttnKernel(api)
    q, k, v_, dout = (x[0].to(torch.bfloat16).contiguous() for x in tensors(16, 4, 2, seed=3))
    cu = torch.tensor([0, 6, 16], dtype=torch.int32)
    kw = dict(scale=D**-0.5, causal=True, left=-1, right=-1, softcap=None)
    out, lse = kernel.forward(q, k, v_, cu, cu, 10, 10, **kw)
    dq, dk, dv = kernel.backward(dout, q, k, v_, out, lse, cu, cu, 10, 10, **kw)
    assert sim.calls == {"forward": 1, "backward": 1} and dq.shape == q.shape and dk.shape == k.shape


def test_lse_of_rows_without_keys_is_neg_inf():
    backend, _ = _backend("2.8.3")
    q, k, v, _ = tensors(32, 4, 2, seed=1)
    cu = [0, 5, 22, 23, 32]
    q_runs, k_runs = make_runs(cu)[1:3], make_runs(cu)[0:2]  # doc 2's queries see no key
    qi, ki, vi = q[:, 5:23].transpose(1, 2), k[:, :22].transpose(1, 2), v[:, :22].transpose(1, 2)
    out, lse = kernels.varlen_forward(qi, ki, vi, q_runs, k_runs, scale=0.3, causal=True, backend=backend)
    assert torch.isneginf(lse[:, :, 17]).all() and (out[:, :, 17] == 0).all() and torch.isfinite(lse[:, :, :17]).all()


# ---- dispatch ------------------------------------------------------------------------

@pytest.fixture
def counted_math(monkeypatch):
    calls = []

    def fwd(*a, **kw):
        calls.append("forward")
        return select.math_kernel.math_forward(*a, **kw)

    def bwd(*a, **kw):
        calls.append("backward")
        return select.math_kernel.math_backward(*a, **kw)

    monkeypatch.setattr(select, "MATH", TiledBackend("math", fwd, bwd, expand_gqa=False))
    return calls


def _use_env(monkeypatch, env):
    monkeypatch.setattr(select, "probe_env", lambda device: env)


@pytest.mark.parametrize("flash", ["2.6.3", "2.7.4", None])
@pytest.mark.parametrize("layout", ["packed", "zigzag", "random"])
@pytest.mark.parametrize("causal,window,softcap", [(True, None, None), (True, 5, None), (False, 3, None), (True, None, 2.0)])
def test_no_tile_reaches_the_math_kernel(monkeypatch, counted_math, flash, layout, causal, window, softcap):
    """bf16 on an emulated CUDA machine: every call goes to the fast kernel the table
    allows (nothing measured: torch's flash ops, flash-attn for softcap); a packed micro-batch
    is one varlen call each way; bf16 results agree with the math kernel to bf16 precision."""
    env, sims = cuda_env(flash=flash)
    _use_env(monkeypatch, env)
    cu, q_runs, k_runs = layout_of(layout)
    q, k, v, dout = (x.transpose(1, 2) for x in tensors(40, 4, 2, seed=3, dtype=torch.bfloat16))
    q, k, v, dout = q[:, :, runs_to_indices(q_runs)], k[:, :, runs_to_indices(k_runs)], v[:, :, runs_to_indices(k_runs)], dout[:, :, runs_to_indices(q_runs)]
    kw = dict(scale=D**-0.5, causal=causal, window=window, softcap=softcap)
    if softcap is not None and flash is None:  # only flash-attn has softcap: math, with one warning naming why
        with pytest.warns(RuntimeWarning, match="torch_flash has no logit softcap"):
            kernels.varlen_forward(q, k, v, q_runs, k_runs, **kw)
        assert counted_math
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = kernels.varlen_forward(q, k, v, q_runs, k_runs, **kw)
        grads = kernels.varlen_backward(dout, q, k, v, out, lse, q_runs, k_runs, **kw)
    assert counted_math == []
    sim = sims["flash_attn" if softcap is not None else "torch_flash"]  # flash-attn only where it alone is exact
    if window is None and layout != "random":  # packed docs / a zigzag step: one call per block pair
        assert sim.calls == {"forward": 1, "backward": 1}
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    m_out, m_lse = kernels.varlen_forward(q, k, v, q_runs, k_runs, backend=select.MATH, **kw)
    m_grads = kernels.varlen_backward(dout, q, k, v, m_out, m_lse, q_runs, k_runs, backend=select.MATH, **kw)
    # Both paths compute in fp32 and round once to bf16 (eps 2^-8): a wrong mask or
    # alignment changes whole rows (O(1) relative error).
    assert rel_err(out, m_out) < 1e-2
    torch.testing.assert_close(lse, m_lse, rtol=1e-4, atol=1e-4)
    for g, m in zip(grads, m_grads):
        assert rel_err(g, m) < 2e-2


@pytest.mark.parametrize("case,expect,reason", [
    (dict(dtype=torch.float32), "math", "not float32"),
    (dict(head_dim=512), "math", "not 512"),
    (dict(head_dim=12), "math", "not 12"),
    (dict(capability=(7, 5)), "math", "compute capability >= 8.0"),
    (dict(flash=None, softcap=30.0), "math", "no logit softcap"),
    (dict(flash="2.5.9"), "torch_flash", None),
    (dict(softcap=30.0), "flash_attn", None),
    (dict(torch_impl="FA3"), "torch_flash[FA3]", None),
    (dict(torch_impl="FA3", softcap=30.0), "flash_attn", None),
    (dict(), "torch_flash", None),  # nothing measured: torch's flash ops
    (dict(ranking=("flash_attn", "torch_flash")), "flash_attn", None),  # measured faster
    (dict(ranking=("cudnn", "torch_flash"), cudnn="H,T"), "cudnn", None),
    (dict(ranking=("cudnn", "torch_flash"), cudnn="H,T", window=64), "torch_flash", None),  # cuDNN: no window
    (dict(ranking=("cudnn", "torch_flash"), cudnn="H,T", head_dim=256), "torch_flash", None),
    (dict(ranking=("cudnn",), cudnn="H,T", cudnn_version=91300), "torch_flash", None),  # too old: next exact
    (dict(ranking=("cudnn_frontend", "torch_flash"), frontend=True, window=64), "cudnn_frontend", None),
    (dict(ranking=("torch_flash[FA3]", "torch_flash"), torch_impl="FA3"), "torch_flash[FA3]", None),
    (dict(ranking=("torch_flash",), torch_impl="FA3"), "torch_flash[FA3]", None),  # the user's switch, unmeasured
    (dict(flash=None), "torch_flash", None),
    (dict(flash=None, cudnn="H,T"), "torch_flash", None),  # cuDNN unmeasured: not picked automatically
])
def test_dispatch_follows_the_capability_table(case, expect, reason):
    env, _ = cuda_env(flash=case.get("flash", "2.8.3"), capability=case.get("capability", (9, 0)),
                      torch_impl=case.get("torch_impl"), cudnn=case.get("cudnn"),
                      cudnn_version=case.get("cudnn_version", 91400), frontend=case.get("frontend", False))
    kw = dict(dtype=case.get("dtype", torch.bfloat16), head_dim=case.get("head_dim", 128), softcap=case.get("softcap"),
              window=case.get("window"), choice=select.AttentionChoice(ranking=case.get("ranking", ())))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        chosen = select.select_backend(env, **kw)
    assert chosen.name == expect
    messages = [str(w.message) for w in seen]
    if reason is None:
        assert messages == []
    else:
        assert len(messages) == 1 and reason in messages[0]


def test_cpu_dispatch_and_table():
    cpu = select.KernelEnv("cpu", cpu_op=True)
    assert select.select_backend(cpu, dtype=torch.bfloat16, head_dim=64, softcap=None).name == "aten_cpu"
    assert select.select_backend(cpu, dtype=torch.float32, head_dim=64, softcap=50.0).name == "math"
    assert select.probe_env(torch.device("cpu")).cpu_op
    table = markdown_table()
    assert all(f"| {name} |" in table for name in CAPABILITIES)
    page = Path(__file__).resolve().parents[2] / "docs" / "concepts" / "usp.md"
    assert table in page.read_text(), "docs/concepts/usp.md's kernel capability table differs from capabilities.markdown_table()"



def test_right_window_stays_below_max_keys():
    """flash-attn 2 reads window_size_right >= max_seqlen_k as unbounded (the emulation does
    too): a causal tile trimmed to 14 rows over 5 keys has right 9, so the call's max_k is
    raised above it; the exactness tests above fail when it is not."""
    from hf_longctx.ops.backends.packed import _kernel_max_k

    assert _kernel_max_k(9, 5) == 10 and _kernel_max_k(2, 5) == 5 and _kernel_max_k(-1, 5) == 5


@pytest.mark.parametrize("kind", ["aten_cpu", "math", "2.8.3", "torch"])
@pytest.mark.parametrize("layout", ["packed", "zigzag"])
def test_outputs_are_token_major(kind, layout):
    """Every backend returns out [B, H, Sq, D] laid out [B, Sq, H, D] in memory, also for a row
    of several documents that the tiled drivers assemble tile by tile: `usp_attention` hands it to
    the model token-major, so no layout copy is made whatever kernel runs (the planner budgets
    none; tests/unit/test_memory_budget_tasks.py)."""
    from hf_longctx.ops.backends.select import ATEN_CPU, MATH

    dtype = torch.float64 if kind in ("math", "2.8.3", "torch") else torch.float32
    backend = {"aten_cpu": ATEN_CPU, "math": MATH}.get(kind) or _backend(kind)[0]
    cu, q_runs, k_runs = layout_of(layout)
    q, k, v, _ = tensors(40, 4, 2, seed=1, dtype=dtype)
    qi, ki, vi = (x[:, runs_to_indices(r)].transpose(1, 2) for x, r in ((q, q_runs), (k, k_runs), (v, k_runs)))
    for out_dtype in (None, torch.float32):
        out, _ = kernels.varlen_forward(qi, ki, vi, q_runs, k_runs, scale=D**-0.5, causal=True, backend=backend,
                                        out_dtype=out_dtype)
        assert out.transpose(1, 2).is_contiguous(), (kind, layout, out.shape, out.stride())
