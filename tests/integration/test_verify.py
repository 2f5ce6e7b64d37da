"""verify(): catches each class of silently wrong model when the structural rule is off, and
passes on the exact families of the CI subset, on 2 gloo ranks (ring 2), with no side
effect on the model.

verify() patches its copy with unsafe_skip_exactness_check=True, so what is tested is the
numerical comparison alone. The wrong classes the model zoo shows, each made to happen:
- a Mamba mixer run on shards (Jamba: Mamba-1 has no wrapper and unsafe leaves it as is);
- a linear mixer run on shards: Qwen3-Next (Gated DeltaNet) and LFM2 (short convolution)
  with the SP mixer wrappers switched off (`plan_mixers` returns nothing);
- attention sinks ignored: gpt-oss with an attention that drops `s_aux`;
- a dropped relative-position bias (+ short convolutions): Inkling;
- a chunked mask run as full causal attention: Llama 4.
fp32 tolerances are verify's own (loss 1e-5, gradients 1e-4 of the largest); each wrong
class misses them by 2x or more (the closest: LFM2's short convolution on shards, 3x, since
its error reaches only the tokens next to a shard boundary), and each exact family stays
below a tenth of them.
"""

from __future__ import annotations

from hf_longctx.verify import GRAD_TOL, LOSS_TOL
from tests.helpers.pool import worker_mesh

# model type -> how the wrong class is produced (None: the model as built)
WRONG = {
    "jamba": None,  # Mamba-1 on shards
    "qwen3_next": "no_wrappers",  # Gated DeltaNet on shards
    "lfm2": "no_wrappers",  # short convolution on shards
    "gpt_oss": "drop_sinks",  # sinks ignored
    "inkling_text": None,  # relative-position bias dropped (+ convolutions on shards)
    "llama4_text": None,  # chunked local attention run as full causal
}
# every EXACT model of the CI subset (tests/integration/test_zoo_subset.py) and then some;
# PhiMoE samples its experts in training mode: verify compares in eval mode, so it passes
EXACT = ["llama", "mixtral", "mistral", "phimoe", "gemma3_text", "gpt_oss", "nemotron_h", "qwen3_next", "lfm2"]
EXACT_WITH = {"gpt2": "hidden_dropout"}  # residual/embedding dropout 0.1: verify compares in eval mode


def _verify_all(cases: list[tuple[str, str | None]]) -> dict:
    import torch
    import transformers as tf

    import hf_longctx.integrations.mixers.registry as mixers
    import hf_longctx.integrations.model_patch as itf
    from benchmarks.zoo import tiny_config
    from hf_longctx import VerificationError, verify

    from transformers import AttentionInterface

    out = {}
    make_attention, plan_mixers = itf.make_attention, mixers.plan_mixers
    registered = set(AttentionInterface._global_mapping)

    def dropping_sinks(state):
        inner = make_attention(state)
        return lambda *a, **kw: inner(*a, **{k: v for k, v in kw.items() if k != "s_aux"})

    for t, fault in cases:
        torch.manual_seed(0)
        cfg = tiny_config(tf.CONFIG_MAPPING[t])
        if fault == "hidden_dropout":
            cfg.resid_pdrop = cfg.embd_pdrop = 0.1
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).train()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        rng = torch.get_rng_state()
        if fault == "drop_sinks":
            itf.make_attention = dropping_sinks
        if fault == "no_wrappers":
            mixers.plan_mixers = lambda *a, **kw: ([], {})
        key = f"{t}:{fault}"
        try:
            res = verify(model, worker_mesh(1, 2))
            out[key] = f"PASS {res['grad']:.3e}"
        except VerificationError as e:
            out[key] = f"CAUGHT {e}"
        finally:
            itf.make_attention, mixers.plan_mixers = make_attention, plan_mixers
        clean = torch.equal(rng, torch.get_rng_state()) and model.training
        clean &= all(p.grad is None and torch.equal(p, before[n]) for n, p in model.named_parameters())
        clean &= set(AttentionInterface._global_mapping) == registered  # its patched copy is unpatched
        out[key + ":clean"] = clean
    return out


def test_verify_catches_every_wrong_class_and_passes_exact_ones(pools):
    cases = list(WRONG.items()) + [(t, None) for t in EXACT] + list(EXACT_WITH.items())
    results = pools.get(2).run(_verify_all, cases, timeout=600)
    for rank, res in enumerate(results):
        for t, fault in WRONG.items():
            r = res[f"{t}:{fault}"]
            assert r.startswith("CAUGHT") and "worst parameter" in r, f"rank {rank} {t} ({fault}): {r}"
            loss_err = float(r.split("loss relative error ")[1].split(" ")[0])
            grad_err = float(r.split("has a gradient error of ")[1].split(" ")[0])
            assert grad_err >= 2 * GRAD_TOL or loss_err >= 2 * LOSS_TOL, f"rank {rank} {t} ({fault}) misses by < 2x: {r}"
        for t, how in [(t, None) for t in EXACT] + list(EXACT_WITH.items()):
            r = res[f"{t}:{how}"]
            assert r.startswith("PASS") and float(r.split()[1]) <= GRAD_TOL / 10, f"rank {rank} {t} ({how}): {r}"
        assert all(v for k, v in res.items() if k.endswith(":clean")), f"rank {rank}: side effect {res}"
    assert results[0] == results[1]  # every rank reaches the same verdict (no rank-local raise)


def test_verify_refuses_meta_weights():
    """A model on the meta device (the non-zero ranks of broadcast_from_rank0) cannot be
    verified; every rank of the SP group agrees on that before any other collective."""
    import pytest
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_longctx import init_sequence_parallel, verify

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    with pytest.raises(ValueError, match="meta device"):
        verify(model, init_sequence_parallel())


def _tiny_llama(device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(cfg)


def test_patch_verify_true_runs_verify_before_changing_the_model():
    """`hf_longctx.patch(..., verify=True)` (the public patch of hf_longctx/patching.py) runs
    verify() after the structural checks and before installing anything: a model verify()
    refuses (weights on meta) stays unpatched; without verify=True the same model patches."""
    import pytest

    from hf_longctx import init_sequence_parallel, is_patched, patch, unpatch

    mesh = init_sequence_parallel()
    model = _tiny_llama("meta")
    with pytest.raises(ValueError, match="meta device"):
        patch(model, mesh, verify=True)
    assert not is_patched(model)
    assert patch(model, mesh) is model and is_patched(model)
    unpatch(model)


def test_patch_verify_true_patches_an_exact_model_and_repatches():
    """verify=True on an exact model returns it patched; patching again with verify=True
    re-runs the check rather than returning early (the idempotent path is only taken
    without it)."""
    from unittest import mock

    import hf_longctx.patching as patching
    from hf_longctx import init_sequence_parallel, is_patched, patch, unpatch

    mesh = init_sequence_parallel()
    model = _tiny_llama("cpu")
    with mock.patch.object(patching, "_verify", wraps=patching._verify) as spy:
        assert patch(model, mesh, verify=True) is model and is_patched(model)
        assert spy.call_count == 1
        patch(model, mesh, verify=False)  # same options: the idempotent early return
        assert spy.call_count == 1
    unpatch(model)
    with mock.patch.object(patching, "_verify", wraps=patching._verify) as spy:
        patch(model, mesh)
        patch(model, mesh, verify=True)  # verify=True again: unpatch, check, patch
        assert spy.call_count == 1 and is_patched(model)
    unpatch(model)
