"""verify(): catches each class of silently wrong model when the structural rule is off, and
passes on the exact families, on 2 gloo ranks (ring 2), with no side effect on the model.

verify() patches its copy with unsafe_skip_exactness_check=True, so what is tested is the
numerical comparison alone. fp32 tolerances are verify's own (loss 1e-5, gradients 1e-4 of
the largest); the wrong classes measured here miss them by 50x or more (sinks 0.2, Mamba
5e-3, chunked mask 0.4, short convolutions + dropped relative bias 7e-3).
"""

from __future__ import annotations

from tests.pool import worker_mesh


def _verify_all(types: list[str]) -> dict:
    import torch
    import transformers as tf
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from benchmarks.zoo import tiny_config
    from hf_longctx import VerificationError, verify

    out = {}
    for t in types:
        torch.manual_seed(0)
        cfg = tiny_config(tf.CONFIG_MAPPING[t])
        model = getattr(tf, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[t])._from_config(cfg, dtype=torch.float32).train()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        rng = torch.get_rng_state()
        try:
            verify(model, worker_mesh(1, 2))
            out[t] = "PASS"
        except VerificationError as e:
            out[t] = f"CAUGHT {e}"
        clean = torch.equal(rng, torch.get_rng_state()) and model.training
        clean &= all(p.grad is None and torch.equal(p, before[n]) for n, p in model.named_parameters())
        out[t + ":clean"] = clean
    return out


def test_verify_catches_every_wrong_class_and_passes_exact_ones(pools):
    from hf_longctx.integrations.transformers import USED_ATTENTION_KWARGS

    wrong = ["jamba", "inkling_text", "llama4_text"]  # SSM mixer, dropped relative bias (+ convolutions), chunked mask
    exact = ["llama", "mixtral", "mistral", "gemma3_text"]
    (wrong if "s_aux" not in USED_ATTENTION_KWARGS else exact).append("gpt_oss")  # sinks ignored until applied
    results = pools.get(2).run(_verify_all, wrong + exact, timeout=300)
    for rank, res in enumerate(results):
        for t in wrong:
            assert res[t].startswith("CAUGHT") and "worst parameter" in res[t], f"rank {rank} {t}: {res[t]}"
        for t in exact:
            assert res[t] == "PASS", f"rank {rank} {t}: {res[t]}"
        assert all(v for k, v in res.items() if k.endswith(":clean")), f"rank {rank}: side effect {res}"
    assert results[0] == results[1]  # every rank reaches the same verdict (no rank-local raise)
