"""`generation/settings.py` against transformers' own resolution and processors.

The settings resolve a field as `generate` does (explicit > the model's generation_config >
transformers' global defaults: top_k 50 when nobody sets it); the processors they build give the
same scores, bit for bit, as the list `GenerationMixin._get_logits_processor` builds for the
same options and a left-padded batch (a drift guard on transformers' private method: if a new
release adds a processor for these options, this fails). Refused options are named with the fix.
"""

from __future__ import annotations

import pytest
import torch

from hf_longctx.errors import NotSupported
from hf_longctx.generation.settings import logits_processors, sampling_settings
from tests.helpers.families import family_config

CONFIGS = [
    dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
    dict(do_sample=True),  # top_k 50 from transformers' defaults
    dict(do_sample=False, repetition_penalty=1.2),
    dict(do_sample=True, top_k=0, top_p=0.5),
]


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(family_config("llama")).eval()


@pytest.mark.parametrize("options", CONFIGS)
def test_processors_give_generates_scores(model, options):
    from transformers import GenerationConfig
    from transformers.generation.logits_process import LogitsProcessorList

    ids = torch.tensor([[0, 0, 5, 17, 42], [8, 8, 31, 9, 9]])  # a left-padded batch (pad 0)
    mask = (torch.arange(5)[None] >= torch.tensor([[2], [0]])).long()
    gc, _ = model._prepare_generation_config(GenerationConfig(max_new_tokens=4, eos_token_id=3, pad_token_id=0, **options))
    theirs = model._get_logits_processor(gc, input_ids_seq_length=5, encoder_input_ids=ids, prefix_allowed_tokens_fn=None,
                                         logits_processor=LogitsProcessorList(), device="cpu",
                                         model_kwargs={"attention_mask": mask})
    settings = sampling_settings(model=model, max_new_tokens=4, eos_token_id=3, pad_token_id=0, **options)
    ours = logits_processors(settings, torch.tensor([2, 0]))
    assert [type(p) for p in ours] == [type(p) for p in theirs]
    scores = torch.randn(2, 128, generator=torch.Generator().manual_seed(3))
    assert torch.equal(ours(ids, scores.clone()), theirs(ids, scores.clone()))


def test_unset_fields_resolve_as_generate():
    s = sampling_settings(max_new_tokens=3, do_sample=True, eos_token_id=[3, 4])
    assert (s.top_k, s.temperature, s.top_p, s.eos_token_ids, s.pad_token_id) == (50, 1.0, 1.0, (3, 4), 3)


@pytest.mark.parametrize("option,value", [("num_beams", 2), ("no_repeat_ngram_size", 3), ("suppress_tokens", [5]),
                                          ("min_new_tokens", 2), ("stop_strings", ["x"]), ("typical_p", 0.5)])
def test_options_that_change_tokens_are_refused_by_name(option, value):
    with pytest.raises(NotSupported, match=f"{option}=") as e:
        sampling_settings(max_new_tokens=3, **{option: value})
    assert "per-rank" in str(e.value)


def test_bad_values():
    with pytest.raises(ValueError, match="max_new_tokens"):
        sampling_settings(eos_token_id=3)
    with pytest.raises(ValueError, match="unknown generation options"):
        sampling_settings(max_new_tokens=3, beam_width=2)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sampling_settings(max_new_tokens=3, do_sample=True, temperature=0.0)
