"""Tests of the per-document cost model T(l) = a·l² + b·l + c (data/cost.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from transformers import GPT2Config, LlamaConfig

from hf_longctx.data.cost import CostModel


def test_call_scalar_and_array():
    cost = CostModel(2.0, 3.0, 5.0)
    assert cost(10) == pytest.approx(2 * 100 + 30 + 5)
    assert isinstance(cost(10), float)
    out = cost([0, 1, 10])
    assert isinstance(out, np.ndarray) and out.dtype == np.float64
    np.testing.assert_allclose(out, [5.0, 10.0, 235.0])
    np.testing.assert_allclose(cost(np.array([4], dtype=np.int32)), [2 * 16 + 12 + 5])
    # Large lengths must not overflow int arithmetic.
    assert cost(np.array([2**20]))[0] == pytest.approx(2.0 * 2**40 + 3.0 * 2**20 + 5.0)


@settings(max_examples=40, deadline=None)
@given(
    st.floats(0, 10), st.floats(0, 1e4), st.floats(0, 1e6),
    st.lists(st.integers(1, 100_000), min_size=3, max_size=30, unique=True),
)
def test_fit_recovers_noiseless_coefficients(a, b, c, lengths):
    truth = CostModel(a, b, c)
    fitted = CostModel.fit(lengths, truth(lengths))
    np.testing.assert_allclose(fitted(lengths), truth(lengths), rtol=1e-6, atol=1e-6 * (1 + truth(lengths).max()))


def test_fit_with_noise_and_seconds():
    rng = np.random.default_rng(0)
    lengths = rng.integers(128, 65536, size=200)
    truth = CostModel(3e-11, 2e-6, 1e-3)  # seconds
    times = truth(lengths) * rng.normal(1.0, 0.02, size=lengths.size)
    fitted = CostModel.fit(lengths, times)
    # Ordinary least squares weighs long documents most: within 5 % where time is spent,
    # within 1 % of the largest time everywhere.
    grid = np.array([256, 4096, 32768, 65536])
    np.testing.assert_allclose(fitted(grid[1:]), truth(grid[1:]), rtol=0.05)
    np.testing.assert_allclose(fitted(grid), truth(grid), atol=0.01 * truth(65536))


def test_fit_keeps_coefficients_non_negative():
    # Times falling with length then rising: an unconstrained fit has b < 0.
    lengths = np.array([1, 2, 3, 4, 5, 6], dtype=float)
    times = (lengths - 3.0) ** 2
    fitted = CostModel.fit(lengths, times)
    assert min(fitted.a, fitted.b, fitted.c) >= 0
    unconstrained = np.polyfit(lengths, times, 2)
    assert unconstrained[1] < 0


@pytest.mark.parametrize(
    "lengths, times, match",
    [
        ([1, 2], [1, 2], "at least 3 distinct"),
        ([1, 1, 1, 2], [1, 1, 1, 2], "at least 3 distinct"),
        ([1, 2, 3], [1, 2], "3 lengths but 2 times"),
        ([1, 2, -3], [1, 2, 3], "negative length"),
        ([1, 2, 3], [1, float("nan"), 3], "finite"),
    ],
)
def test_fit_errors(lengths, times, match):
    with pytest.raises(ValueError, match=match):
        CostModel.fit(lengths, times)


@pytest.mark.parametrize("bad", [dict(a=-1.0, b=1.0), dict(a=1.0, b=float("inf")), dict(a="1", b=1.0)])
def test_rejects_bad_coefficients(bad):
    with pytest.raises(ValueError):
        CostModel(**bad)


def test_from_config_llama_gqa():
    config = LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000,
    )
    cost = CostModel.from_config(config)
    head_dim = 16
    per_layer = 2 * 64 * 64 + 2 * 64 * 2 * head_dim + 3 * 64 * 176  # q,o + k,v + gated MLP
    assert cost.b == 6 * (3 * per_layer + 64 * 1000)
    assert cost.a == 6 * 3 * 64
    assert cost.c == 0


def test_from_config_gpt2_plain_mlp():
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=500)
    cost = CostModel.from_config(config)
    per_layer = 4 * 32 * 32 + 2 * 32 * 128  # attention + 4h two-matrix MLP
    assert cost.b == 6 * (2 * per_layer + 32 * 500)
    assert cost.a == 6 * 2 * 32


def test_from_config_names_missing_attribute():
    class Bare:
        hidden_size = 8

    with pytest.raises(ValueError, match="num_hidden_layers"):
        CostModel.from_config(Bare())


def test_from_config_moe_counts_every_active_expert_and_unwraps_multimodal():
    from transformers import Gemma3Config, MixtralConfig

    # Mixtral has no moe_intermediate_size: each token passes through num_experts_per_tok
    # experts of intermediate_size, so the gated MLP term is 3·h·(k·i) per layer.
    c = MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, num_local_experts=8, num_experts_per_tok=2)
    q, kv = 64, 2 * 16
    per_layer = 2 * 64 * q + 2 * 64 * kv + 3 * 64 * (2 * 96)
    assert CostModel.from_config(c) == CostModel(a=6.0 * 2 * q, b=6.0 * (2 * per_layer + 64 * 100))
    # A multimodal config is reduced to its text config (no top-level hidden_size).
    g = Gemma3Config()
    assert CostModel.from_config(g) == CostModel.from_config(g.get_text_config())
