"""Selection by measurement: the measured-fraction table, the choice a call carries, the option.

What fails here: a backend picked automatically without a fraction measured on the GPU (or given
another backend's fractions), a ranking not ordered by the model's seconds, a GPU name mapped to
the wrong entry, `patch(attention_backend=...)` accepting a name select.py does not know or not
reaching the kernel choice, a named backend refused after a collective instead of before, the
planner not saying which kernel it models.
"""

import math

import pytest
import torch

from hf_longctx.capacity import gpus
from hf_longctx.capacity.cluster import Cluster
from hf_longctx.config import ATTENTION_BACKENDS, PatchOptions
from hf_longctx.ops import kernels
from hf_longctx.ops.backends import CAPABILITIES, AttentionChoice, select
from hf_longctx.integrations.attention_choice import attention_choice, measured_ranking


def test_option_names_are_the_selectable_backends():
    """Every name the option takes is a backend select.py can return, and every backend is nameable."""
    flash_variants = {"torch_flash[FA3]", "torch_flash[FA4]"}
    assert set(ATTENTION_BACKENDS) == set(CAPABILITIES) | flash_variants


def test_patch_options_validate_the_backend():
    assert PatchOptions.resolve("max", {}, 1, attention_backend="cudnn").attention_backend == "cudnn"
    assert PatchOptions.resolve(None, {}, 1).attention_backend is None
    with pytest.raises(ValueError, match="attention_backend must be None .* got 'fa3'"):
        PatchOptions(attention_backend="fa3")


def test_ranking_orders_measured_backends_by_modelled_seconds():
    """Seconds per pair 4 / fwd + 10 / bwd at the nearest head dim: a backend faster in the
    backward outranks one faster only in the forward; an unmeasured backend is absent."""
    spec = gpus.GPU("X", 1e15, 1e12, 8e10, 1e11, 1e10, 1e10, 1e10, measured_attention=(
        ("torch_flash", ((128, 0.37, 0.29),)), ("cudnn", ((128, 0.30, 0.50),)), ("flash_attn", ((64, 0.9, 0.9),)),
    ))
    assert spec.attention_ranking(128) == ("flash_attn", "cudnn", "torch_flash")  # one row each: nearest is theirs
    assert spec.modelled_attention(128) == "flash_attn"
    fastest = gpus.with_attention_backend(spec, None)
    assert fastest.attention_fraction(128, backward=True) == 0.9 and fastest.modelled_attention(128) == "flash_attn"
    named = gpus.with_attention_backend(spec, "cudnn")
    assert named.modelled_attention(128) == "cudnn" and named.attention_fraction(128, backward=False) == 0.30
    with pytest.raises(ValueError, match="no measured attention fractions of 'cudnn_frontend' on X"):
        gpus.with_attention_backend(spec, "cudnn_frontend")


def test_shipped_table_measures_only_torch_flash():
    """Today's table: torch's FA2 on the H200 (carried to the H100, same die), nothing on an
    A100; the model's seconds are unchanged by the table (the same fractions as before)."""
    for key in ("h100", "h200"):
        assert gpus.GPUS[key].attention_ranking(128) == ("torch_flash",)
        assert gpus.GPUS[key].attention_fraction(128, False) == 0.366
    assert gpus.GPUS["a100"].attention_ranking(128) == ()
    assert gpus.GPUS["a100"].modelled_attention(64) == "torch_flash"
    with pytest.raises(ValueError, match="measured: none"):
        Cluster(gpus=8, gpu_memory=80e9, host_memory=2e12, gpu="a100", attention_backend="torch_flash")
    assert Cluster(gpus=8, gpu_memory=80e9, host_memory=2e12, gpu="h200").gpu_spec.modelled_attention(128) == "torch_flash"


@pytest.mark.parametrize("name,key", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA H100 PCIe", None), ("NVIDIA H100 NVL", None), ("NVIDIA L40S", None),
])
def test_device_names_map_to_entries(name, key):
    assert gpus.key_of_device(name) == key


def test_choice_carries_the_named_backend_or_the_ranking():
    q = torch.zeros(1, 4, 2, 8)
    assert attention_choice("cudnn", q) == AttentionChoice("cudnn", ())
    assert attention_choice(None, q) == AttentionChoice(None, ())  # CPU: nothing measured
    assert measured_ranking(torch.device("cpu"), 128) == ()


def test_batch_backend_keys_the_choice(monkeypatch):
    """One micro-batch memo holds one backend per (device, dtype, head dim, softcap, window,
    choice): a different choice or window is chosen anew, the same is not."""
    calls = []
    monkeypatch.setattr(kernels, "backend_for", lambda q, **kw: calls.append(kw) or select.MATH)
    memo, q = {}, torch.zeros(1, 2, 4, 8)
    for window, choice in ((None, None), (None, None), (4, None), (None, AttentionChoice("math")), (4, None)):
        kernels.batch_backend(q, softcap=None, memo=memo, window=window, choice=choice)
    assert [(c["window"], c["choice"]) for c in calls] == [(None, None), (4, None), (None, AttentionChoice("math"))]


def test_a_named_backend_is_refused_before_any_collective():
    """On a CPU mesh of one rank a CUDA backend named by the user raises from usp_attention before
    the Ulysses all-to-all (none has run: the group is never touched)."""
    from hf_longctx.ops.usp import usp_attention

    class Untouched:  # a mesh whose groups cannot be reached: reading one means a collective was on its way
        ulysses, ring, ring_rank, fpdt_chunks, sp = 2, 1, 0, 1, 2

        def check_boundaries(self, cu):
            return cu

        def __getattr__(self, name):
            raise AssertionError(f"the mesh's {name} was read: a collective was on its way")

    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises((ValueError, AssertionError)) as info:
        usp_attention(q, q, q, Untouched(), cu_seqlens=[0, 8], softmax_scale=1 / math.sqrt(8),
                      attention_backend=AttentionChoice("cudnn"))
    assert info.type is ValueError and "runs on CUDA" in str(info.value)
