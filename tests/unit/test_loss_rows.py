"""Rows per LM-head chunk (`ops/loss_rows.py`): one rule, the runtime and the planner alike.

- "auto" (the presets): at least 2048 rows where the sequence has them (Llama-3.1-8B at 32K
  tokens: 2048, where the memory rule alone cut 256-row chunks), the memory rule's larger chunks
  at long sequences (4,178 rows at 1M), one chunk for a shorter sequence;
- a count (`loss_chunks=N`) and rows (`loss_chunk_rows=R`) given by the user are taken as given;
  rows go with "auto" chunks only (a preset, or loss_chunks="auto"), refused otherwise with both
  values named;
- a patched model's chunked loss and log-prob head cut the rows the planner's budget
  (`capacity/budget_terms.loss_rows`) and step time (`capacity/step_time.shape_of`) count.
"""

from __future__ import annotations

import pytest
import torch

from hf_longctx.ops.loss_rows import COMPUTE_ROWS, MIN_ROWS, config_sizes, loss_chunk_rows, memory_rows

V8B, H8B = 128256, 4096


def test_auto_rows_are_compute_bound_where_the_sequence_allows():
    assert loss_chunk_rows(V8B, H8B, 1 << 15) == COMPUTE_ROWS == 2048
    assert memory_rows(V8B, H8B, 1 << 15) == MIN_ROWS  # the memory rule alone: 256-row chunks
    assert loss_chunk_rows(V8B, H8B, 1 << 20) == memory_rows(V8B, H8B, 1 << 20) == 4178  # ceil(2^20 / 251)
    assert memory_rows(V8B, H8B, 131072) == 523 and loss_chunk_rows(V8B, H8B, 131072) == 2048
    assert loss_chunk_rows(V8B, H8B, 1500) == 1500  # shorter than a chunk: one chunk
    assert loss_chunk_rows(1000, 32, 5000) == 2048 and memory_rows(1000, 32, 5000) == MIN_ROWS


def test_a_users_count_or_rows_are_taken_as_given():
    assert loss_chunk_rows(V8B, H8B, 1 << 15, chunks=3) == 10923  # ceil(32768 / 3)
    assert loss_chunk_rows(V8B, H8B, 10, chunks=64) == 1 and loss_chunk_rows(V8B, H8B, 100, chunks=None) == 100
    assert loss_chunk_rows(V8B, H8B, 1 << 15, chunk_rows=300) == 300
    assert loss_chunk_rows(V8B, H8B, 200, chunk_rows=300) == 200
    with pytest.raises(ValueError, match="rows=0"):
        loss_chunk_rows(V8B, H8B, 0)


def test_config_sizes_read_the_text_config_and_name_what_is_missing():
    from transformers import GPT2Config, LlamaConfig

    assert config_sizes(GPT2Config(vocab_size=50257, n_embd=768)) == (50257, 768)  # hidden_size via attribute_map
    with pytest.raises(ValueError, match="hidden_size=None"):
        config_sizes(type("Bare", (), {"vocab_size": 5})())
    assert config_sizes(LlamaConfig(vocab_size=96, hidden_size=64)) == (96, 64)


def test_loss_chunk_rows_goes_with_auto_chunks_only():
    from hf_longctx.config import PatchOptions

    assert PatchOptions.resolve("max", {}, 1, loss_chunk_rows=512).loss_chunk_rows == 512
    assert PatchOptions.resolve(None, {"loss_chunks": "auto"}, 1, loss_chunk_rows=512).loss_chunk_rows == 512
    for memory, knobs in (("off", {}), (None, {"loss_chunks": 4}), (None, {})):
        with pytest.raises(ValueError, match=r"loss_chunk_rows=512 sets the rows .* loss_chunks="):
            PatchOptions.resolve(memory, knobs, 1, loss_chunk_rows=512)
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="loss_chunk_rows must be None or an int >= 1"):
            PatchOptions.resolve("max", {}, 1, loss_chunk_rows=bad)


def _runtime_rows(options: dict, tokens: int) -> list[int]:
    """The chunk sizes a patched tiny Llama's chunked loss and log-prob head use on `tokens` rows."""
    import transformers as tf

    from hf_longctx import init_sequence_parallel
    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.integrations import memory
    from hf_longctx.integrations.logprob_head import logprob_chunk_rows
    from hf_longctx.integrations.model_patch import patch

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2))
    mesh = init_sequence_parallel(1, 1)
    seen: list[int] = []
    original = memory.chunked_causal_lm_loss

    def recorded(*args, chunk_size, **kwargs):
        seen.append(chunk_size)
        return original(*args, chunk_size=chunk_size, **kwargs)

    memory.chunked_causal_lm_loss = recorded
    try:
        patch(model, mesh, **options)
        ids = torch.randint(0, 64, (1, tokens), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            model(**shard_batch({"input_ids": ids, "labels": ids.clone()}, mesh))
    finally:
        memory.chunked_causal_lm_loss = original
    return seen + [logprob_chunk_rows(model, tokens)]


@pytest.mark.parametrize("options,setting", [
    ({"memory": "balanced"}, {}),
    ({"memory": "max", "loss_chunk_rows": 1000}, {"loss_chunk_rows": 1000}),
    ({"loss_chunks": 3}, {"loss_chunks": 3}),
])
def test_runtime_and_planner_cut_the_same_rows(options, setting):
    from transformers import LlamaConfig

    from hf_longctx.capacity.budget_terms import loss_rows
    from hf_longctx.capacity.estimate import ModelDims, Setting
    from hf_longctx.capacity.step_time import shape_of

    tokens = 2600
    dims = ModelDims.from_config(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2))
    s = Setting(ulysses=1, ring=1, **({"loss_chunks": 0} | setting))
    planned = shape_of(dims, s, tokens).loss_chunk
    assert planned == loss_rows(dims, tokens, s.loss_chunks, s.loss_chunk_rows)
    loss, head = _runtime_rows(options, tokens)
    assert loss == planned and (head == planned or "loss_chunks" in options), (loss, head, planned)
    assert planned == {"memory": 2048, "loss_chunk_rows": 1000, "loss_chunks": 867}[next(iter(setting), "memory")]


def test_the_planner_lowers_the_chunk_only_where_gpu_memory_binds():
    """Llama-3.1-8B, 2 layers, one GPU, 32K tokens, memory="balanced" (whose loss phase is its
    peak from about 1024 rows on): with room, every setting keeps the "auto" 2048-row chunk; on
    a GPU between the auto chunk's estimated peak and the memory rule's, the setting is still
    offered, with the largest multiple of 128 rows that fits (one step more does not) in its
    suggestion's code and flags."""
    from dataclasses import replace

    from transformers import LlamaConfig

    from hf_longctx.capacity.estimate import ModelDims, estimate_memory
    from hf_longctx.capacity.fits import ROW_STEP
    from hf_longctx.capacity.search import Cluster, preset_setting, rank_settings
    from hf_longctx.capacity.suggestion import Suggestion

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256)
    dims, tokens = ModelDims.from_config(cfg), 1 << 15
    roomy = Cluster(gpus=1, gpu_memory=141e9, host_memory=2e12, gpu="h200")
    assert all(c.setting.loss_chunk_rows == 0 for c in rank_settings(cfg, roomy, tokens, param_offload="no"))
    s = preset_setting(1, 1, 1, "balanced", dims)
    peak = lambda rows: estimate_memory(dims, replace(s, loss_chunk_rows=rows), world=1, tokens=tokens).peak  # noqa: E731
    assert peak(256) < peak(1024) < peak(1024 + ROW_STEP) < peak(0)  # 0: the auto chunk, 2048 rows
    tight = replace(roomy, gpu_memory=peak(1024) / (1 - roomy.headroom))
    (c,) = [c for c in rank_settings(cfg, tight, tokens, param_offload="no")
            if c.preset == "balanced" and c.setting.fpdt_chunks == 1]
    rows = c.setting.loss_chunk_rows
    usable = tight.gpu_memory * (1 - tight.headroom)
    assert c.feasible and rows == 1024 and peak(rows) <= usable < peak(rows + ROW_STEP), (rows, c.reason)
    hint = Suggestion.of(c, tokens)
    assert "loss_chunk_rows=1024)" in hint.code() and "--loss-chunk-rows 1024" in hint.recipe_flags()
