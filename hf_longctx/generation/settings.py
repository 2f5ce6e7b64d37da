"""How a sequence-parallel rollout samples: the options transformers' `generate` would use, resolved
the way it resolves them, and its logits processors in its order.

Where it sits: `generation/loop.sp_generate` and the rollout trainers (TRL's GenerationConfig)
build a `SamplingSettings` before anything runs; `generation/sampler.py` applies it per step.
Guarantees: a value is taken from the caller, else from the model's `generation_config`, else
from transformers' global defaults (`_compat.generation_defaults`: top_k 50 when nobody set it),
as `generate` does; the processors are transformers' own classes, built as
`GenerationMixin._get_logits_processor` builds them for these options (repetition penalty with
left-padding ignored, then temperature, top-k, top-p, min-p), so the same scores reach the same
sampling call. Every option that would change the tokens and is not applied here (beams, n-gram
bans, forced or suppressed tokens, stop strings, ...) is refused by name before generation.
TRL 1.16's GRPOTrainer / RLOOTrainer set temperature, top_p, top_k, min_p, repetition_penalty,
eos, pad and max_new_tokens (docs/guides/grpo.md "Rollouts")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hf_longctx._compat import generation_defaults, repetition_penalty_skips_padding
from hf_longctx.errors import NotSupported

READ = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "eos_token_id",
        "pad_token_id")
# Options that change which tokens come out and are not applied here: (name, is it on?).
_REFUSED = (
    ("num_beams", lambda v: v is not None and v > 1), ("num_beam_groups", lambda v: v is not None and v > 1),
    ("penalty_alpha", lambda v: v is not None), ("diversity_penalty", lambda v: v not in (None, 0.0)),
    ("no_repeat_ngram_size", lambda v: bool(v)), ("encoder_no_repeat_ngram_size", lambda v: bool(v)),
    ("encoder_repetition_penalty", lambda v: v not in (None, 1.0)), ("bad_words_ids", lambda v: bool(v)),
    ("force_words_ids", lambda v: bool(v)), ("constraints", lambda v: bool(v)), ("min_length", lambda v: bool(v)),
    ("min_new_tokens", lambda v: bool(v)), ("typical_p", lambda v: v is not None and v < 1.0),
    ("epsilon_cutoff", lambda v: bool(v)), ("eta_cutoff", lambda v: bool(v)), ("top_h", lambda v: v is not None),
    ("suppress_tokens", lambda v: bool(v)), ("begin_suppress_tokens", lambda v: bool(v)),
    ("forced_bos_token_id", lambda v: v is not None), ("forced_eos_token_id", lambda v: v is not None),
    ("sequence_bias", lambda v: bool(v)), ("guidance_scale", lambda v: v not in (None, 1.0)),
    ("renormalize_logits", lambda v: bool(v)), ("remove_invalid_values", lambda v: bool(v)),
    ("exponential_decay_length_penalty", lambda v: v is not None), ("stop_strings", lambda v: bool(v)),
    ("watermarking_config", lambda v: v is not None), ("num_return_sequences", lambda v: v is not None and v > 1),
    ("prompt_lookup_num_tokens", lambda v: v is not None), ("dola_layers", lambda v: v is not None),
    ("token_healing", lambda v: bool(v)), ("output_scores", lambda v: bool(v)), ("output_logits", lambda v: bool(v)),
    ("return_dict_in_generate", lambda v: bool(v)), ("output_attentions", lambda v: bool(v)),
    ("output_hidden_states", lambda v: bool(v)),
)


@dataclass(frozen=True)
class SamplingSettings:
    """The resolved options of one rollout (`sampling_settings` makes them as `generate` would).

    Attributes:
        max_new_tokens: Completion tokens per row at most (>= 1).
        do_sample: False: greedy (argmax after the processors, as `generate`).
        temperature: Logits divided by it when sampling (> 0).
        top_k: Keep the k most likely tokens.
        top_p: Keep the smallest set with this much probability.
        min_p: Keep tokens at least this fraction of the most likely one's probability.
        repetition_penalty: transformers' penalty on the tokens of a row's history.
        eos_token_ids: The stop tokens (a completion ends after the first).
        pad_token_id: What finished rows are padded with.
    """

    max_new_tokens: int
    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if self.do_sample and self.temperature is not None and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature!r}; use do_sample=False "
                             "for greedy decoding")


def _resolved(explicit: dict[str, Any], model_config: Any) -> dict[str, Any]:
    """explicit value > the model's generation_config > transformers' global default, per field."""
    defaults = generation_defaults()
    names = set(READ) | {name for name, _ in _REFUSED}
    out = {}
    for name in names:
        value = explicit.get(name)
        if value is None and model_config is not None:
            value = getattr(model_config, name, None)
        out[name] = defaults.get(name) if value is None else value
    return out


def sampling_settings(generation_config: Any = None, model: Any = None, **options: Any) -> SamplingSettings:
    """The settings of `generate(generation_config=..., **options)` on `model`.

    Args:
        generation_config: A transformers GenerationConfig (explicit options; keywords on top).
        model: Its generation_config fills what is not given explicitly, then transformers' defaults.
        **options: `generate` keywords (max_new_tokens, do_sample, temperature, top_k, top_p, min_p,
            repetition_penalty, eos_token_id, pad_token_id).

    Returns:
        The resolved `SamplingSettings`.

    Raises:
        NotSupported: Naming every option that is on and not applied (beams, n-gram bans, ...).
        ValueError: An unknown option or a bad value; no max_new_tokens.
    """
    explicit = dict(generation_config.to_dict()) if generation_config is not None else {}
    explicit.update(options)
    unknown = sorted(set(options) - set(READ) - {name for name, _ in _REFUSED} - {"cache_implementation", "use_cache"})
    if unknown:
        raise ValueError(f"unknown generation options {unknown}; sp_generate takes {', '.join(READ)}")
    values = _resolved(explicit, getattr(model, "generation_config", None))
    on = [f"{name}={values[name]!r}" for name, is_on in _REFUSED if values.get(name) is not None and is_on(values[name])]
    if on:
        raise NotSupported(
            f"sequence-parallel generation does not apply {', '.join(on)} (it applies {', '.join(READ)})",
            "drop these options (from generation_kwargs and the model's generation_config), or generate on the "
            "per-rank path (generation='per-rank'), which runs transformers' own generate",
        )
    if values["max_new_tokens"] is None:
        raise ValueError("sequence-parallel generation needs max_new_tokens (the cache is sized by it); max_length "
                         "alone is not read")
    eos = values["eos_token_id"]
    eos = () if eos is None else (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)
    pad = values["pad_token_id"]
    if pad is None:  # transformers pads finished rows with the first EOS id then
        pad = eos[0] if eos else 0
    return SamplingSettings(
        max_new_tokens=int(values["max_new_tokens"]), do_sample=bool(values["do_sample"]),
        temperature=values["temperature"], top_k=values["top_k"], top_p=values["top_p"], min_p=values["min_p"],
        repetition_penalty=values["repetition_penalty"], eos_token_ids=eos, pad_token_id=int(pad),
    )


def logits_processors(settings: SamplingSettings, pad_lengths: torch.Tensor):
    """transformers' processors for `settings`, in `_get_logits_processor`'s order; `pad_lengths` [B]:
    each row's left padding in the sampler's history (the repetition penalty ignores it where
    `generate` does, from the prompt's attention mask: `_compat.repetition_penalty_skips_padding`)."""
    from transformers.generation.logits_process import (
        LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
        TopKLogitsWarper, TopPLogitsWarper,
    )

    s = settings
    procs = LogitsProcessorList()
    if s.repetition_penalty is not None and s.repetition_penalty != 1.0:
        skip = pad_lengths if repetition_penalty_skips_padding() else None
        procs.append(RepetitionPenaltyLogitsProcessor(s.repetition_penalty, prompt_ignore_length=skip))
    if s.do_sample:  # the warpers act only when sampling, as in generate
        if s.temperature is not None and s.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(s.temperature))
        if s.top_k is not None and s.top_k != 0:
            procs.append(TopKLogitsWarper(top_k=s.top_k, min_tokens_to_keep=1))
        if s.top_p is not None and s.top_p < 1.0:
            procs.append(TopPLogitsWarper(top_p=s.top_p, min_tokens_to_keep=1))
        if s.min_p is not None:
            procs.append(MinPLogitsWarper(min_p=s.min_p, min_tokens_to_keep=1))
    return procs
