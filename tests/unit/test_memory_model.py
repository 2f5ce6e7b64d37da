"""The planner's memory model (`hf_longctx.capacity.estimate`) against hand computations,
against what autograd really saves, and against one measured peak."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from hf_longctx.capacity.estimate import ModelDims, Setting, estimate_memory


def _llama(**kw) -> LlamaConfig:
    base = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512, max_position_embeddings=1 << 16)
    return LlamaConfig(**(base | kw))


@pytest.mark.parametrize(
    "config, model_cls",
    [(_llama(), LlamaForCausalLM), (_llama(attention_bias=True, tie_word_embeddings=True), LlamaForCausalLM),
     (Qwen2Config(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512), Qwen2ForCausalLM)],
    ids=["llama", "llama-bias-tied", "qwen2"],
)
def test_param_count_is_exact(config, model_cls):
    assert ModelDims.from_config(config).params == model_cls(config).num_parameters()


def test_param_count_by_hand():
    d = ModelDims.from_config(_llama())
    layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 160 + 2 * 64  # q, o; k, v (2 KV heads x 16); MLP; norms
    assert d.layer_params == layer
    assert d.params == 2 * layer + 2 * 512 * 64 + 64  # embeddings + LM head (untied) + final norm


def test_zero3_divides_by_world_and_adds_the_fsdp_working_set():
    d = ModelDims.from_config(_llama())
    p = d.params
    one = estimate_memory(d, Setting(1, 1), world=1, tokens=1024, dtype="fp32")
    assert (one.params, one.grads, one.optimizer) == (4 * p, 4 * p, 8 * p)  # fp32 + fp32 + two fp32 moments
    eight = estimate_memory(d, Setting(2, 1), world=8, tokens=1024, dtype="bf16")
    # FSDP units: layers, the embedding, the LM head (each resharded after use), the root (final norm, 64).
    head = 512 * 64
    assert eight.params == 4 * p / 8 + 2 * (64 + max(2 * d.layer_params, head + d.layer_params))  # shard + gathered
    assert eight.grads == 4 * p / 8 + 2 * (64 + max(d.layer_params, head))  # one unit's unsharded grads
    assert eight.optimizer == 8 * p / 8
    assert estimate_memory(d, Setting(1, 1), world=1, tokens=1024, optimizer="sgd").optimizer == 0


def test_activations_scale_with_local_tokens_and_options_move_them():
    d = ModelDims.from_config(_llama())
    sp2 = estimate_memory(d, Setting(2, 1), world=4, tokens=8192)
    # Ulysses 4 > 2 KV heads: each KV head is replicated twice, so the saved k and v double.
    sp4 = estimate_memory(d, Setting(4, 1), world=4, tokens=8192)
    kv_extra = d.layers * (8192 / 4) * 2 * 2 * d.kv_heads * d.head_dim  # 2 bytes (bf16) x (k, v), one more replica
    assert sp4.activations == pytest.approx(sp2.activations / 2 + kv_extra, rel=1e-12)  # S/sp tokens per GPU
    s_l = 8192 / 2
    ckpt = estimate_memory(d, Setting(2, 1, checkpoint=True, mlp_chunks=2, loss_chunks=0), world=4, tokens=8192)
    assert ckpt.host == d.layers * s_l * 2 * d.hidden  # saved layer inputs, bf16, on host (one buffer each)
    chunked = dict(fpdt_chunks=4, mlp_chunks=8, loss_chunks=0)
    fpdt = estimate_memory(d, Setting(2, 1, kv_offload=True, **chunked), world=4, tokens=8192)
    on_device = estimate_memory(d, Setting(2, 1, **chunked), world=4, tokens=8192)
    moved = d.layers * s_l * (2 * d.heads * d.head_dim + 2 * 2 * d.kv_heads * d.head_dim + 4 * d.heads)  # q, k, v, lse
    assert fpdt.host == moved and fpdt.activations == pytest.approx(on_device.activations - moved, rel=1e-12)


@pytest.mark.parametrize(
    "setting, message",
    [(Setting(3, 1), "does not divide"), (Setting(2, 2, fpdt_chunks=2), "needs ring 1"),
     (Setting(2, 1, kv_offload=True), "kv_offload"), (Setting(8, 1), "divisible by ulysses")],
)
def test_invalid_settings_raise(setting, message):
    with pytest.raises(ValueError, match=message):
        estimate_memory(ModelDims.from_config(_llama()), setting, world=8, tokens=1024)


def _shard(model, tokens: int, mesh):
    from hf_longctx import shard_batch

    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(tokens // 2)] * 2)[None]
    return shard_batch({"input_ids": ids, "labels": ids.clone(), "position_ids": pos}, mesh)


@pytest.mark.parametrize("checkpoint", [False, True], ids=["chunked", "checkpointed"])
def test_estimate_within_10_percent_of_measured_peak(checkpoint):
    """MemTracker peak of one fp32 AdamW step (one process, chunked loss + MLP, with and
    without checkpointing, a row of two documents) against the estimate; 10 % is the target,
    the benchmark shows 1-4 % at larger sizes. The checkpointed layers run row chunks under
    torch's ModTracker hooks."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from hf_longctx import init_sequence_parallel, patch

    torch.manual_seed(0)
    config = _llama(hidden_size=128, intermediate_size=352, num_attention_heads=4, vocab_size=2048)
    model = LlamaForCausalLM(config)
    mesh = init_sequence_parallel(1, 1)
    patch(model, mesh, loss_chunks="auto", mlp_chunks="auto", checkpoint=checkpoint)  # the chunks the planner models
    opt = torch.optim.AdamW(model.parameters())
    shard = _shard(model, 2048, mesh)

    def step():
        model(**shard).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step()
    peak = max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    # On CPU the checkpointed inputs are read in place (offload=False): nothing goes to a host. The
    # tracker sees tensors, not a kernel's internal scratch: the planner's kernel term (flash-attn 2's
    # backward workspace) is left out (kernel_workspace=0), as the census tests count it apart; so
    # the comparison does not depend on which CPU attention kernel runs (make test-memory-isa).
    est = estimate_memory(ModelDims.from_config(config), Setting(1, 1, mlp_chunks=4, loss_chunks=0, checkpoint=checkpoint), world=1,
                          tokens=2048, dtype="fp32", offload=False, kernel_workspace=0.0).peak
    assert abs(est / peak - 1) < 0.10, (est, peak)
