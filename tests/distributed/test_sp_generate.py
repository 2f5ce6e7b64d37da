"""`sp_generate` on 4 gloo ranks against transformers' `generate` of the unpatched model in one process.

Greedy: token for token equal to `generate` of each prompt alone, on Ulysses 4, ring 4, U2×R2,
dp2×U2 (FSDP2 over the world, weights gathered or left sharded) and Ulysses 4 with FPDT chunks 2,
for GQA (llama), a model with a sliding layer (qwen2), softcaps and a window (gemma2) and attention
sinks (GPT-OSS); the prefill also under memory="max" (row-chunked layers, FPDT's loop). Packed
prompts of 1 to 11 tokens (shorter than the SP degree included), a stop token that ends rows at
different steps. With sharded weights the two DP groups decode different prompts to different
lengths: every rank of the world still runs the same number of forwards (the finished group's
steps are dummies) and nothing hangs; also with the cache in host buffers (cache="host").

Sampled (temperature, top-k, top-p, min-p, repetition penalty on): equal to `generate` under the
same seed, with SP rank 0 sampling every row (reference: all rows as one left-padded batch) and
with each SP rank sampling its own rows (reference: that rank's rows, its seed); the global RNG
is left where `generate` leaves it.
"""

from __future__ import annotations

import pytest

from tests.helpers.generation_cases import greedy_case, sampled_case, save_generation_family


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("generation")
    return {f: save_generation_family(f, root) for f in ("llama", "qwen2", "gemma2", "gpt_oss")}


def _check_greedy(results):
    for rank, r in enumerate(results):
        assert r["got"] == r["want"], (rank, r["got"], r["want"])
    assert any(0 < n < 12 for n in results[0]["lengths"]), results[0]["lengths"]  # a row stopped early
    assert len(set(results[0]["lengths"])) > 1, results[0]["lengths"]  # ragged


@pytest.mark.parametrize("ulysses,ring,fpdt", [(4, 1, 1), (1, 4, 1), (2, 2, 1), (4, 1, 2)])
def test_greedy_llama_every_layout(pools, paths, ulysses, ring, fpdt):
    _check_greedy(pools.get(4).run(greedy_case, paths["llama"], ulysses, ring, fpdt, timeout=300))


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "gpt_oss"])
def test_greedy_windows_softcaps_sinks(pools, paths, family):
    _check_greedy(pools.get(4).run(greedy_case, paths[family], 2, 2, 1, timeout=300))


@pytest.mark.parametrize("ulysses,fpdt", [(2, 1), (4, 2)])
def test_greedy_prefill_under_memory_max(pools, paths, ulysses, fpdt):
    ring = 2 if ulysses == 2 else 1
    _check_greedy(pools.get(4).run(greedy_case, paths["llama"], ulysses, ring, fpdt, memory="max", timeout=300))


@pytest.mark.parametrize("weights,cache", [("gathered", "device"), ("sharded", "device"), ("sharded", "host")])
def test_greedy_dp2_fsdp_no_hang(pools, paths, weights, cache):
    results = pools.get(4).run(greedy_case, paths["llama"], 2, 1, 1, fsdp=True, weights=weights, cache=cache,
                               timeout=300)
    _check_greedy(results)
    assert results[0]["lengths"] != results[2]["lengths"]  # the DP groups decode different rows to different lengths
    if weights == "sharded":
        assert len({r["forwards"] for r in results}) == 1, [r["forwards"] for r in results]  # FSDP2's gathers match


@pytest.mark.parametrize("per_rank_owners", [False, True])
def test_sampled_equals_generate_under_the_same_seed(pools, paths, per_rank_owners):
    results = pools.get(4).run(sampled_case, paths["llama"], 2, 2, per_rank_owners=per_rank_owners, timeout=300)
    for rank, r in enumerate(results):
        assert r["got"] == results[0]["got"], rank  # the SP group shares every row's tokens
        assert r["mine"] == r["want"], (rank, r["mine"], r["want"])
        assert r["rng_after"][0] == r["rng_after"][1], rank
    assert len({len(c) for c in results[0]["got"]}) > 1


def test_bad_input_is_refused_on_every_rank_before_generation(pools, paths):
    from tests.helpers.generation_cases import refusal_case

    expected = {"beams": "num_beams=2", "ngram": "no_repeat_ngram_size=2", "over_plan": "over max_tokens 30",
                "bad_id": "token id 500", "per_rank_prompts": "different rows", "unpatched": "patched"}
    for rank, out in enumerate(pools.get(2).run(refusal_case, paths["llama"], timeout=120)):
        for name, text in expected.items():
            assert text in out[name], (rank, name, out[name])
        assert "Do instead" in out["beams"]
        assert len(out["after"]) == 1
