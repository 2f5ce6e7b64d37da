"""Every attention path returns a contiguous [B, S_local, H, D], as HF's own attention functions do.

Models `.view()` the attention output (AFMoE: `output.view(*input_shape, -1)`; JetMoE's
MoA output projection): a strided result crashed them on ring 2 ("view size is not
compatible with input tensor's size and stride"). Checked on inputs laid out exactly as
the registered attention receives them -- `query.transpose(1, 2)` of HF's [B, H, S, D],
a strided view -- for USP with U×R in (1,1), (2,1), (1,2), FPDT, with and without sinks
(R = 1 with sinks runs the ring Function), packed and B = 2 rows; the values equal those
from contiguous inputs (the same kernels run, so exactly equal). Then JetMoE and AFMoE,
patched on ring 2 and Ulysses 2, against the unpatched model run per document (fp32:
loss 1e-5, gradients 1e-4 relative per tensor, as in test_models.py).
"""

from __future__ import annotations

import pytest
import torch

from hf_longctx import init_sequence_parallel
from hf_longctx.ops.fpdt import fpdt_attention
from hf_longctx.ops.usp import usp_attention
from tests.helpers.sink_models import models_on_mesh
from tests.helpers.pool import worker_mesh


def _layouts(mesh, fpdt: bool) -> dict:
    """is_contiguous and equality with contiguous inputs, per (packed, sinks) variant."""
    attention = fpdt_attention if fpdt else usp_attention
    g = torch.Generator().manual_seed(7)
    h, hkv, d = 4, 2, 8
    s = 4 * mesh.seq_multiple
    out = {}
    for packed in (True, False):
        b = 1 if packed else 2
        cu = [0, s // 4, s] if packed else None
        if packed and s // 4 % mesh.doc_multiple:
            cu = [0, s]
        q_hf, k_hf, v_hf = (torch.randn(b, n, s, d, generator=g) for n in (h, hkv, hkv))  # HF's [B, H(_kv), S, D]
        idx = mesh.local_indices(cu if cu else [0, s])
        for sinks in (None, torch.randn(h, generator=g)):
            strided = [t[:, :, idx].transpose(1, 2) for t in (q_hf, k_hf, v_hf)]  # [B, S_local, H(_kv), D], strided
            dense = [t.contiguous() for t in strided]
            kw = dict(cu_seqlens=cu, sinks=sinks)
            o_strided, o_dense = attention(*strided, mesh, **kw), attention(*dense, mesh, **kw)
            key = f"packed={packed} sinks={sinks is not None}"
            out[key] = (o_strided.is_contiguous(), tuple(o_strided.shape), torch.equal(o_strided, o_dense))
            assert not strided[0].is_contiguous()
    return out


def _on_mesh(ulysses: int, ring: int, chunks: int):
    return _layouts(worker_mesh(ulysses, ring, chunks), chunks > 1)


def _check(results, what):
    for rank, per_variant in enumerate(results):
        for variant, (contiguous, shape, equal) in per_variant.items():
            assert contiguous, f"{what} rank {rank} {variant}: output of shape {shape} is not contiguous"
            assert shape[2:] == (4, 8) and equal, f"{what} rank {rank} {variant}: shape {shape}, equal {equal}"


@pytest.mark.parametrize("chunks", [1, 2])
def test_world1_outputs_are_contiguous(chunks):
    mesh = init_sequence_parallel(1, 1, chunks)
    _check([_layouts(mesh, chunks > 1)], f"(1,1) fpdt_chunks={chunks}")


@pytest.mark.parametrize("ulysses,ring,chunks", [(2, 1, 1), (1, 2, 1), (2, 1, 2)])
def test_world2_outputs_are_contiguous(pools, ulysses, ring, chunks):
    _check(pools.get(2).run(_on_mesh, ulysses, ring, chunks), f"({ulysses},{ring}) fpdt_chunks={chunks}")


# ---- model level: the two families that crashed on ring 2 ---------------------------------


def _config(family: str):
    import transformers as tf

    if family == "jetmoe":
        return tf.JetMoeConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_key_value_heads=2, kv_channels=8,
                               intermediate_size=64, num_local_experts=2, num_experts_per_tok=2)
    if family == "afmoe":  # layer 0 dense + sliding, layer 1 MoE + full; every expert active
        return tf.AfmoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                              num_hidden_layers=2, num_dense_layers=1, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=8, num_experts=2, num_experts_per_tok=2, num_shared_experts=1,
                              global_attn_every_n_layers=2, sliding_window=8)
    raise KeyError(family)


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("contiguous_models")
    paths = {}
    for family in ("jetmoe", "afmoe"):
        torch.manual_seed(0)
        paths[family] = f"{root}/{family}"
        AutoModelForCausalLM.from_config(_config(family)).save_pretrained(paths[family])
    return paths


@pytest.mark.parametrize("ulysses,ring", [(1, 2), (2, 1)])
def test_view_the_output_families_run_exactly(pools, model_paths, ulysses, ring):
    for rank, per_family in enumerate(pools.get(2).run(models_on_mesh, ulysses, ring, model_paths, timeout=300)):
        for family, errs in per_family.items():
            where = f"{family} mesh ({ulysses},{ring}) rank {rank}: {errs}"
            assert "missing_grads" not in errs and errs["loss"] <= 1e-5 and errs["grad"] <= 1e-4, where
