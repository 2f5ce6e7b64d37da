"""Attention sinks (HF's `s_aux`) under USP, ring, Ulysses and FPDT vs a float64 single-process reference.

The reference (`tests/helpers/reference.reference_attention(..., sinks=)`) is HF's eager GPT-OSS
rule: one extra logit column per head, softmaxed with the scores and dropped. Checked:
forward output, dq/dk/dv and the sink gradient (summed over the SP group, as every
parameter gradient is), for U×R in (1,1), (2,1), (1,2), (2,2), (4,1), (1,4), FPDT u = 2
on 2 ranks and u = 4 on 4 ranks; MHA, GQA with H_kv < U, packed uneven documents with a
padding document, sliding window, B = 2 unpacked rows. The outputs must be contiguous.

Tolerances as in test_usp.py: fp32 relative error <= 2e-5 against float64 (~1e-7 is
measured; a sink merged once per ring step or per FPDT chunk instead of once gives ~1e-1,
a missing sink gradient 1.0); bf16 no worse than twice single-process bf16 attention.
"""

from __future__ import annotations

import pytest
import torch

from hf_longctx import init_sequence_parallel
from tests.helpers import fpdt_cases, usp_cases
from tests.helpers.pool import worker_mesh
from tests.helpers.sink_cases import CASES, FP32_TOL
from tests.helpers.sink_models import models_on_mesh, save_with_visible_sinks


def _usp(ulysses: int, ring: int, dtype_name: str, cases: list[dict]):
    mesh = worker_mesh(ulysses, ring)
    return [usp_cases._case(mesh, c, getattr(torch, dtype_name)) for c in cases]


def _fpdt(ulysses: int, chunks: int, dtype_name: str, cases: list[dict]):
    mesh = worker_mesh(ulysses, 1, chunks)
    return [fpdt_cases._case(mesh, c, getattr(torch, dtype_name)) for c in cases]


def _check_fp32(results, layout):
    for rank, per_rank in enumerate(results):
        for case, errs in zip(CASES, per_rank):
            assert any(name.endswith("dsink") for name in errs), errs
            for name, e in errs.items():
                assert e <= FP32_TOL, f"{layout} rank {rank} case {case}: {name} rel err {e:.2e} > {FP32_TOL} ({errs})"


def test_world1_fp32():
    mesh = init_sequence_parallel()
    _check_fp32([[usp_cases._case(mesh, c, torch.float32) for c in CASES]], "(1,1)")


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2)])
def test_world2_fp32(pools, ulysses, ring):
    _check_fp32(pools.get(2).run(_usp, ulysses, ring, "float32", CASES), (ulysses, ring))


@pytest.mark.parametrize("ulysses,ring", [(2, 2), (4, 1), (1, 4)])
def test_world4_fp32(pools, ulysses, ring):
    _check_fp32(pools.get(4).run(_usp, ulysses, ring, "float32", CASES), (ulysses, ring))


@pytest.mark.parametrize("world,ulysses,chunks", [(2, 2, 2), (4, 4, 4)])
def test_fpdt_fp32(pools, world, ulysses, chunks):
    _check_fp32(pools.get(world).run(_fpdt, ulysses, chunks, "float32", CASES), f"fpdt U={ulysses} u={chunks}")


def test_bf16_no_worse_than_twice_single_process(pools):
    cases = CASES[1:2]
    for layout, fn, args in (("ring 2", _usp, (1, 2)), ("fpdt U=2 u=2", _fpdt, (2, 2))):
        for rank, per_rank in enumerate(pools.get(2).run(fn, *args, "bfloat16", cases)):
            errs = per_rank[0]
            for name in ("out", "dq", "dk", "dv", "dsink"):
                assert errs[name] <= 2 * errs["base_" + name], f"{layout} rank {rank}: {name} {errs}"


def test_bad_sinks_raise_before_any_collective():
    from hf_longctx.ops.fpdt import fpdt_attention
    from hf_longctx.ops.usp import usp_attention

    x = torch.zeros(1, 8, 4, 8)
    for attention, mesh in ((usp_attention, init_sequence_parallel()), (fpdt_attention, init_sequence_parallel(1, 1, 2))):
        with pytest.raises(ValueError, match=r"sinks must be a floating tensor of shape \[H\] = \[4\].*\(2,\)"):
            attention(x, x, x, mesh, sinks=torch.zeros(2))


# ---- model level: every sink family of transformers, patched, vs the unpatched model ------

# Tiny configs: 2 layers (one sliding with a window shorter than the documents, one full),
# GQA, MoE with every expert active (top-k = number of experts: routing cannot flip on a
# rounding difference, and no auxiliary loss: output_router_logits stays False).
WINDOW = 8
SINK_FAMILIES = ["gpt_oss", "flint", "granite_swa", "granitemoe_swa", "mimo_v2_flash"]


def sink_family_config(family: str):
    import transformers as tf

    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
    moe = dict(num_experts_per_tok=2, output_router_logits=False)
    if family == "gpt_oss":
        return tf.GptOssConfig(**common, head_dim=8, num_local_experts=2, **moe)
    if family == "flint":
        return tf.FlintConfig(**common, head_dim=8, num_experts=2, moe_intermediate_size=16, shared_expert_intermediate_size=16, **moe)
    if family == "granite_swa":
        return tf.GraniteSWAConfig(**common, bos_token_id=1, eos_token_id=2)
    if family == "granitemoe_swa":
        return tf.GraniteMoeSWAConfig(**common, num_local_experts=2, **moe)
    if family == "mimo_v2_flash":  # sinks on its sliding layer only (s_aux=None on the full one)
        return tf.MiMoV2FlashConfig(**common, head_dim=8, v_head_dim=8, n_routed_experts=2, moe_intermediate_size=16, **moe)
    raise KeyError(family)


def _save_sink_family(family: str, root) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return save_with_visible_sinks(AutoModelForCausalLM.from_config(sink_family_config(family)), f"{root}/{family}")


@pytest.fixture(scope="module")
def sink_model_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("sink_models")
    return {family: _save_sink_family(family, root) for family in SINK_FAMILIES if _installed(family)}


def _installed(family: str) -> bool:
    """The family exists in the installed transformers (Flint is newer than the 5.19 floor);
    at the pinned transformers every family must."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from hf_longctx._compat import package_version

    if family in CONFIG_MAPPING_NAMES:
        return True
    assert package_version("transformers") < (5, 24), f"{family} is missing from the pinned transformers"
    return False


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2)])
def test_sink_families_match_single_process(pools, sink_model_paths, ulysses, ring):
    """Loss 1e-5 and every gradient (the sinks' included) 1e-4, relative per tensor, as in
    test_models.py; the sinks must get a nonzero gradient (they got none before sinks were
    supported, and the loss was off by ~1e-3)."""
    for rank, per_family in enumerate(pools.get(2).run(models_on_mesh, ulysses, ring, sink_model_paths, timeout=300)):
        for family, errs in per_family.items():
            where = f"{family} mesh ({ulysses},{ring}) rank {rank}: {errs}"
            assert "missing_grads" not in errs, where
            assert errs["sink_params"] >= 1 and errs["min_sink_grad"] > 0, where
            assert errs["loss"] <= 1e-5 and errs["grad"] <= 1e-4 and errs["sink_grad"] <= 1e-4, where
