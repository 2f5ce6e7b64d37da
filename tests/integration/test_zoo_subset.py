"""The CI subset of benchmarks/zoo.py: one family per kind through patch() on 2 gloo ranks
(Ulysses 2 and ring 2) vs the unpatched model, with the expected verdicts and causes."""

from __future__ import annotations

import pytest

from benchmarks.zoo import overall, run_zoo

EXPECTED = {
    "llama": ("EXACT", ""),  # dense
    "mixtral": ("EXACT", ""),  # MoE
    "mistral": ("EXACT", ""),  # sliding window (5 < documents), asserted active below
    "gemma3_text": ("EXACT", ""),  # text model of a multimodal family, sliding + full layers
    # sinks: REFUSED until sequence-parallel attention applies `s_aux`; then EXACT (helper `sinks`)
    "gpt_oss": ("REFUSED", "s_aux"),
    "jamba": ("REFUSED", "Mamba-1"),  # SSM hybrid without a wrapper (Mamba-1)
    "nemotron_h": ("EXACT", ""),  # SSM hybrid (Mamba-2 wrapper)
    "qwen3_next": ("EXACT", ""),  # linear-attention hybrid (Gated DeltaNet wrapper)
    "lfm2": ("EXACT", ""),  # convolution hybrid (halo short-conv wrapper)
    "deepseek_v32": ("REFUSED", "Indexer"),  # sparse-attention indexer
    "llama4_text": ("REFUSED", "chunked"),  # Llama 4: chunked local attention
}


@pytest.mark.timeout(900)
def test_zoo_subset_verdicts(pools):
    from hf_longctx.integrations.transformers import USED_ATTENTION_KWARGS

    expected = dict(EXPECTED)
    if "s_aux" in USED_ATTENTION_KWARGS:
        expected["gpt_oss"] = ("EXACT", "")
    rows = {r["model_type"]: r for r in run_zoo(list(expected), pool=pools.get(2), timeout=240, log=lambda s: None)}
    for t, (verdict, cause) in expected.items():
        row = rows[t]
        assert overall(row) == verdict and set(row["verdict"].values()) == {verdict}, f"{t}: {row}"
        assert cause in row.get("reason", ""), f"{t}: cause {cause!r} not in {row.get('reason')}"
    assert rows["mistral"]["features"].get("window_active") is True
    assert rows["gemma3_text"]["features"].get("window_active") is True
