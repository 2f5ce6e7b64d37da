"""The CI subset of benchmarks/zoo.py: one family per kind through patch() on 2 gloo ranks
(Ulysses 2 and ring 2) vs the unpatched model, with the expected verdicts and causes.

Kinds covered (one model may cover several, to keep this under a minute): dense + sliding
window (Mistral, window 5 < documents, asserted active), MoE + attention sinks + sliding
window (gpt-oss), a sliding window carried only by the masks + random routing (PhiMoE), multimodal family's text model (Gemma 3, sliding + full layers), SSM
hybrid with a wrapper (Nemotron-H, Mamba-2) and without (Jamba, Mamba-1: refused),
linear-attention hybrid (Qwen3-Next, Gated DeltaNet), convolution hybrid (LFM2), sparse
indexer (DeepSeek-V3.2: refused), Llama 4 (chunked local attention: refused), MoE families
(LongCat-Flash, Qwen3-MoE, Mixtral).
"""

from __future__ import annotations

import pytest

from benchmarks.zoo import overall, run_zoo
from tests.helpers.transformers_release import on_attention_interface

EXPECTED = {
    "mistral": ("EXACT", ""),
    "phimoe": ("EXACT", ""),  # a window only its masks carry; random routing in training (compared in eval mode)
    "gpt_oss": ("EXACT", ""),
    "gemma3_text": ("EXACT", ""),
    "nemotron_h": ("EXACT", ""),
    "jamba": ("REFUSED", "Mamba-1"),
    "qwen3_next": ("EXACT", ""),
    "lfm2": ("EXACT", ""),
    "deepseek_v32": ("REFUSED", "Indexer"),
    "llama4_text": ("REFUSED", "chunked"),
    # MoE families (top-k routers, shared / zero experts, fused expert weights). The zoo's batch
    # does not force an expert to be idle on one rank; tests/distributed/test_moe_unused_experts.py
    # does (sum_gradients, FSDP2, the Trainer and the flexible step, 2 and 4 ranks).
    "longcat_flash": ("EXACT", ""),
    "qwen3_moe": ("EXACT", ""),
    "mixtral": ("EXACT", ""),
}
# transformers 5.24 moved GPT-J onto AttentionInterface: from then on it must be exact on 2 ranks
# (before, tests/integration/test_patch.py checks it is refused).
if on_attention_interface("transformers.models.gptj.modeling_gptj"):
    EXPECTED["gptj"] = ("EXACT", "")
# Gemma 4 passes `labels` down **kwargs to its attention (the dry run's run A computes the loss
# with labels): a loss target, never an attention input -- exact, not refused for it.
if on_attention_interface("transformers.models.gemma4.modeling_gemma4"):
    EXPECTED["gemma4"] = ("EXACT", "")


@pytest.mark.timeout(600)
def test_zoo_subset_verdicts(pools):
    rows = {r["model_type"]: r for r in run_zoo(list(EXPECTED), pool=pools.get(2), timeout=240, log=lambda s: None)}
    for t, (verdict, cause) in EXPECTED.items():
        row = rows[t]
        assert overall(row) == verdict and set(row["verdict"].values()) == {verdict}, f"{t}: {row}"
        assert cause in row.get("reason", ""), f"{t}: cause {cause!r} not in {row.get('reason')}"
    assert rows["phimoe"]["features"].get("train_mode_random") is True
    for t in ("mistral", "gpt_oss", "gemma3_text", "phimoe"):
        assert rows[t]["features"].get("window_active") is True, f"{t}: {rows[t]['features']}"
