"""memory="max": a projection runs once per row chunk in the forward and once in the recompute;
`post` runs none of what feeds only its replayed attention (norms, projections, RoPE).

`LayerSplit.post` reruns a decoder layer on a row chunk with the attention replayed; the
projections before the attention call feed only the attention there, so after one backward
has shown (no gradient path to the layer's output) which ones, `post` gives them placeholders.
Counted (benchmarks/row_chunks.projection_gemms: aten GEMMs reading q_proj's weight and writing
its output features) in a step after a warm-up: 2u per step for u row chunks (forward pre,
backward recompute; the backward's pre with gradients reads no q_proj output, so it runs no
GEMM there: `integrations/unread_outputs.py`), while the module is still called 5u times.
Without the placeholders (fault: `projection` always runs the GEMM) it is 4u. A gated
attention (Qwen3.5: q_proj also makes the output gate) keeps its q_proj in `post`, and two
steps stay exact against memory="off" (fp32: gradients 1e-5 relative, as test_layer_split).
"""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks.row_chunks import projection_gemms
from tests.helpers.patched_steps import patched_steps
from tests.helpers.reference import rel_err

torch.set_num_threads(1)


@pytest.mark.parametrize("u", [2, 8])
def test_q_proj_runs_twice_per_chunk(u):
    gemms, calls = projection_gemms(u)
    assert gemms == 2 * u, (gemms, calls)
    assert calls == 5 * u  # the module is still called; post's calls return placeholders


def _qwen35():
    import transformers as tf

    torch.manual_seed(0)
    return tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(
        vocab_size=56, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, layer_types=["full_attention", "full_attention"], pad_token_id=0))


def _two_steps(model, **options):
    loss, grads, learnt, model = patched_steps(model, **options)
    return [loss] + grads, learnt, model

def test_a_gated_attention_keeps_its_query_projection_and_stays_exact():
    base = _qwen35()
    ref, _, _ = _two_steps(copy.deepcopy(base), memory="off")
    got, learnt, model = _two_steps(copy.deepcopy(base), checkpoint=True, mlp_chunks=4, loss_chunks="auto")
    layer = model.model.layers[0]
    attn = layer.self_attn
    skipped = learnt[id(layer)].keys()
    assert id(attn.q_proj) not in skipped and {id(attn.k_proj), id(attn.v_proj)} <= skipped, skipped
    # q_proj feeds the gate, so the input norm runs; q and k feed only the replayed attention
    assert id(layer.input_layernorm) not in skipped and {id(attn.q_norm), id(attn.k_norm), "apply_rotary_pos_emb"} <= skipped
    assert rel_err(got[0], ref[0]) <= 1e-6
    bad = {i: rel_err(a, b) for i, (a, b) in enumerate(zip(got[1:], ref[1:])) if rel_err(a, b) > 1e-5}
    assert not bad, bad


def test_post_skips_the_input_norm_projections_and_rope_of_llamas_form_and_stays_exact():
    """Llama's form: the input norm, q, k, v and RoPE feed only the replayed attention in `post`
    (skipped from the second step); o_proj, the post-attention norm and the MLP run. Two steps
    exact against memory="off" (fp32, as the gated case)."""
    import transformers as tf

    torch.manual_seed(0)
    base = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=56, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, pad_token_id=0))
    ref, _, _ = _two_steps(copy.deepcopy(base), memory="off")
    got, learnt, model = _two_steps(copy.deepcopy(base), checkpoint=True, mlp_chunks=4, loss_chunks="auto")
    for layer in model.model.layers:
        attn = layer.self_attn
        skipped = learnt[id(layer)].keys()
        assert skipped == {id(layer.input_layernorm), id(attn.q_proj), id(attn.k_proj), id(attn.v_proj),
                           "apply_rotary_pos_emb"}, skipped
    assert rel_err(got[0], ref[0]) <= 1e-6
    bad = {i: rel_err(a, b) for i, (a, b) in enumerate(zip(got[1:], ref[1:])) if rel_err(a, b) > 1e-5}
    assert not bad, bad


def test_a_rope_of_one_tensor_comes_back_as_one_tensor():
    """CodeGen rotates q and k in two calls of `apply_rotary_pos_emb(x, sin, cos) -> x`: skipped in
    `post`, each call returns its one argument (not a pair), and two steps stay exact."""
    import transformers as tf

    torch.manual_seed(0)
    base = tf.CodeGenForCausalLM(tf.CodeGenConfig(vocab_size=56, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                                                  n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    from hf_longctx.errors import NotSupported

    try:
        ref, _, _ = _two_steps(copy.deepcopy(base), memory="off")
    except NotSupported as e:  # transformers before CodeGen called AttentionInterface
        pytest.skip(f"patch() refuses CodeGen with this transformers: {str(e).splitlines()[0][:120]}")
    got, learnt, model = _two_steps(copy.deepcopy(base), checkpoint=True, mlp_chunks=4, loss_chunks="auto")
    assert all("apply_rotary_pos_emb" in learnt[id(layer)] for layer in model.transformer.h), learnt
    assert rel_err(got[0], ref[0]) <= 1e-6
    bad = {i: rel_err(a, b) for i, (a, b) in enumerate(zip(got[1:], ref[1:])) if rel_err(a, b) > 1e-5}
    assert not bad, bad
