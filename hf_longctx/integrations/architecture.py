"""Encoders and encoder-decoders, refused at `patch()` by their cause, before the dry run.

Where it sits: the first check of `exactness.refuse_inexact`, before anything is changed and
before the dry run (`probe/dry_run.py`) would fail inside the model with a symptom. Decided
from the model alone: an encoder-decoder (T5, BART: bidirectional encoder, cross-attention
to every encoder token); an encoder such as BERT loaded with `is_decoder=False`
(bidirectional self-attention); the same families as decoders whose LM head owns its bias
twice (`cls.predictions.decoder.bias` IS `cls.predictions.bias`), which FSDP2 cannot place
in one unit (`fsdp_units.split_parameters`) and would fail after the collectives started."""

from __future__ import annotations

from typing import Any

from hf_longctx.integrations.fsdp_units import plan_units, split_parameters
from hf_longctx.model_walk import decoder_layer_classes


def _families() -> tuple[frozenset, frozenset]:
    """(model types with a masked-LM head, sequence-to-sequence model types)."""
    from transformers.models.auto import modeling_auto

    masked = frozenset(getattr(modeling_auto, "MODEL_FOR_MASKED_LM_MAPPING_NAMES", {}))
    seq2seq = frozenset(getattr(modeling_auto, "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", {}))
    return masked, seq2seq


def _split(hf: Any) -> list[str]:
    try:
        classes = decoder_layer_classes(hf)
    except ValueError:  # no decoder layers found: FSDPPlan.apply says so itself
        return []
    return split_parameters(hf, plan_units(hf, classes))


def architecture_problems(hf: Any) -> list[str]:
    """Every architectural cause that rules `hf` out, in the order a user should read them."""
    cfg = getattr(hf, "config", None)
    cls, name = type(hf).__name__, type(cfg).__name__
    if getattr(cfg, "is_encoder_decoder", False) is True:
        return [
            f"{cls} is an encoder-decoder model ({name}.is_encoder_decoder=True): its encoder attends in both directions "
            "over the whole input and its decoder cross-attends to every encoder token, which no causal document mask "
            "over sequence shards can express; hf_longctx trains decoder-only causal LMs"
        ]
    masked, seq2seq = _families()
    model_type = getattr(cfg, "model_type", None)
    if model_type not in masked or model_type in seq2seq:
        return []
    problems = []
    if getattr(cfg, "is_decoder", None) is False:
        problems.append(
            f"{cls} is an encoder ('{model_type}' is a masked-LM family and {name}.is_decoder=False): its self-attention "
            "is bidirectional (every token attends to later ones), which a causal LM trained on sequence shards cannot "
            "reproduce; hf_longctx trains decoder-only causal LMs"
        )
    return problems + [f"its LM head cannot be sharded: {line}" for line in _split(hf)]
