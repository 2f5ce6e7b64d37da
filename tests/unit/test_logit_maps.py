"""The chunked loss keeps what a model does to its logits between its LM head and its loss.

`integrations/logit_maps.py` reads the forward: Cohere multiplies the logits by `logit_scale`,
Granite divides them by `logits_scaling`, Falcon-H1 multiplies by `lm_head_multiplier`;
RecurrentGemma softcaps by `logits_soft_cap`; MiniCPM3 scales the hidden states before its head
(nothing to map). A patched model with chunked loss (every memory preset but "off") equals the
model patched with memory="off" (HF's loss on the whole logits) in its loss and gradients (fp32: loss 1e-6 relative, gradients 1e-5 of the largest,
the chunked head's summation order), eager and fused; without the maps the losses are 1.7e-2
(Cohere, logit_scale 3) and 2.8e-3 (Granite, logits_scaling 4) off. A scaling the forward
writes in another form is refused naming the field.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

from tests.helpers.patched_steps import patched_steps
from tests.helpers.reference import rel_err

torch.set_num_threads(1)
SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0)


def _cohere(scale: float = 3.0):
    return tf.CohereForCausalLM(tf.CohereConfig(**SIZES, logit_scale=scale))


def _granite(scaling: float = 4.0):
    return tf.GraniteForCausalLM(tf.GraniteConfig(**SIZES, logits_scaling=scaling))


def test_the_maps_and_softcap_read_from_each_forward():
    from hf_longctx.integrations.logit_maps import logit_maps, logit_softcap

    assert logit_maps(_cohere(0.25)) == (("*", 0.25),)
    assert logit_maps(_granite(4.0)) == (("/", 4.0),)
    assert logit_maps(_granite(1.0)) == ()  # neutral: no op added
    assert logit_maps(tf.LlamaForCausalLM(tf.LlamaConfig(**SIZES))) == ()
    gemma2 = tf.Gemma2ForCausalLM(tf.Gemma2Config(**SIZES, head_dim=8, final_logit_softcapping=30.0))
    assert logit_maps(gemma2) == () and logit_softcap(gemma2) == 30.0  # the softcap is the loss's own argument
    falcon = tf.FalconH1ForCausalLM(tf.FalconH1Config(**SIZES, lm_head_multiplier=0.5))
    assert logit_maps(falcon) == (("*", 0.5),)
    minicpm = tf.MiniCPM3ForCausalLM(tf.MiniCPM3Config(**SIZES, dim_model_base=8))
    assert minicpm.config.logits_scaling != 1 and logit_maps(minicpm) == ()  # its hidden states, before the head
    recurrent = tf.RecurrentGemmaForCausalLM(tf.RecurrentGemmaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        lru_width=32, logits_soft_cap=12.0))
    assert logit_maps(recurrent) == () and logit_softcap(recurrent) == 12.0


class _OddCohere(tf.CohereForCausalLM):
    def forward(self, input_ids=None, **kwargs):  # the scaling in a form the reader does not know
        hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
        logits = torch.mul(self.lm_head(hidden), self.logit_scale)
        return logits


def test_a_scaling_in_another_form_is_refused_naming_it():
    from hf_longctx.integrations.logit_maps import logit_maps

    model = _OddCohere(tf.CohereConfig(**SIZES, logit_scale=0.25))
    with pytest.raises(ValueError, match="logit_scale=0.25"):
        logit_maps(model)


def _loss_and_grads(model, **options):
    loss, grads, _, _ = patched_steps(model, steps=1, **options)
    return loss, grads

@pytest.mark.parametrize("build,fused", [(_cohere, False), (_granite, False), (_cohere, True)],
                         ids=["cohere", "granite", "cohere-fused"])
def test_the_chunked_loss_equals_the_models_loss_with_its_scaling(build, fused):
    torch.manual_seed(0)
    base = build()
    ref_loss, ref_grads = _loss_and_grads(copy.deepcopy(base), memory="off")  # HF's loss on the whole logits
    loss, grads = _loss_and_grads(copy.deepcopy(base), mlp_chunks=2, loss_chunks=3, fused=fused)
    assert rel_err(loss, ref_loss) <= 1e-6, (loss, ref_loss)
    top = max(g.abs().max() for g in ref_grads if g is not None)
    bad = {i: float((a - b).abs().max() / top) for i, (a, b) in enumerate(zip(grads, ref_grads))
           if a is not None and float((a - b).abs().max() / top) > 1e-5}
    assert not bad, bad


class _ScaledHead(torch.nn.Linear):
    """A head as Dory's: a Linear scaling its logits by a learnt per-token parameter."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__(hidden, vocab, bias=False)
        self.logit_scale = torch.nn.Parameter(torch.ones(vocab))

    def forward(self, x):
        return super().forward(x) * self.logit_scale


def test_a_head_computing_more_than_a_linear_layer_is_refused():
    """The chunked loss and log-probabilities compute x @ W.T + b: a head of its own forward
    and parameters (Dory's) would lose both, and the parameter its gradient."""
    from hf_longctx.errors import NotSupported
    from hf_longctx.integrations.logprob_head import check_logprob_head

    model = tf.LlamaForCausalLM(tf.LlamaConfig(**SIZES))
    model.lm_head = _ScaledHead(32, 64)
    with pytest.raises(ValueError, match=r"_ScaledHead computes more than a linear layer .*'logit_scale'"):
        _loss_and_grads(model, loss_chunks=3)
    with pytest.raises(NotSupported, match="_ScaledHead"):
        check_logprob_head(model)
