"""What a trainer builds around `Trainer.__init__`: HF's checkpointing flags mapped onto
`patch(checkpoint=...)`, a constructor argument replaced, the pad id, the model's vocabulary
and the FSDP2 sharding of the model.

Where it sits: construction of the Trainer path, before any step; everything here runs on
every rank alike and before any collective. The checks that refuse are `refusals/checks.py`.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import replace
from typing import Any

from hf_longctx._compat import checkpointing_fields
from hf_longctx.data.token_ids import Vocabulary
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.integrations.accelerate import fsdp_plan
from hf_longctx.integrations.model_patch import patch_state
from hf_longctx.model_walk import hf_model


def map_activation_checkpointing(model: Any, args: Any) -> Any:
    """HF's checkpointing flags as `patch(..., checkpoint=...)`; returns the arguments the
    Trainer gets: a copy of `args` with those flags off, the user's object left as it was (it
    may build a second trainer). An explicit `patch(..., checkpoint=False)` wins over the flag,
    said once; otherwise the flag keeps the mode of the model's preset, or turns on full
    checkpointing."""
    # HF's checkpointing (TRL's SFTConfig turns it on by default) wraps the decoder layers
    # outside our attention binding; patch(checkpoint=True) recomputes them inside it.
    fields = checkpointing_fields(args)  # no `activation_checkpointing` on transformers 5.17
    asked = [f for f in fields if getattr(args, f)]
    if not asked:
        return args
    from hf_longctx.integrations.model_patch import patch_with

    state = patch_state(model)
    if not state.options.checkpoint and "checkpoint" in state.explicit:
        if getattr(args, "process_index", 0) == 0:
            warnings.warn(
                f"{type(args).__name__}({asked[0]}=True) is not applied: the model was patched with checkpoint=False "
                f"explicitly, and patch()'s explicit setting wins; pass {asked[0]}=False to silence this, or "
                "patch(model, mesh, checkpoint=True) (or 'attention') to recompute activations",
                stacklevel=3,
            )
    elif not state.options.checkpoint:  # the preset's knobs stay, checkpointing is added
        patch_with(model, state.bank, replace(state.options, checkpoint=True, memory=None),
                   explicit=state.explicit | {"checkpoint"}, mixers=state.mixers_option,
                   unsafe_skip_exactness_check=state.probe is None)  # a model patched without the dry run stays so
    mapped = copy.copy(args)  # the Trainer reads (and may write) its own copy
    for f in fields:
        setattr(mapped, f, False)
    return mapped


def norm_without_clipping(mapped: Any, user: Any) -> Any:
    """The arguments the Trainer gets: `mapped` (a copy already, or the user's own `user` object,
    then copied here) with `max_grad_norm <= 0` ("no clipping") as `inf`, which clips nothing as
    well: the Trainer then takes every step's norm through `_clip_grad_norm` (the base's: the
    summed gradient's norm, a dead rank named with the step) instead of the accelerator's."""
    norm = getattr(mapped, "max_grad_norm", None)
    if norm is None or norm > 0:
        return mapped
    out = copy.copy(mapped) if mapped is user else mapped
    out.max_grad_norm = float("inf")
    return out


def with_argument(args: tuple, kwargs: dict, names: tuple[str, ...], name: str, value: Any) -> tuple[tuple, dict]:
    """(args, kwargs) of a constructor call with parameter `name` (positional order `names`)
    replaced by `value`, wherever the caller passed it."""
    if name in kwargs:
        return args, {**kwargs, name: value}
    at = names.index(name)
    if at < len(args):
        return (*args[:at], value, *args[at + 1 :]), kwargs
    return args, kwargs


def without_data_skip(trainer_args: Any, user_args: Any) -> Any:
    """The Trainer's arguments with `ignore_data_skip=True` (a copy when they are the user's own
    object): the step sampler's position comes back with the checkpoint (`base/saving.py`), so
    the Trainer must not also skip the trained batches on resume -- its skip would draw and plan
    every skipped step again. TRL's async trainers set it for the same reason."""
    if trainer_args.ignore_data_skip:
        return trainer_args
    out = copy.copy(trainer_args) if trainer_args is user_args else trainer_args
    out.ignore_data_skip = True
    return out


def pad_id(processing_class: Any, pad_token_id: int | None) -> int:
    """`pad_token_id` if given, else the processing class's pad, else its EOS, else 0."""
    if pad_token_id is not None:
        return pad_token_id
    tok = getattr(processing_class, "tokenizer", processing_class)
    for attr in ("pad_token_id", "eos_token_id"):
        if isinstance(getattr(tok, attr, None), int):
            return getattr(tok, attr)
    return 0


def model_vocabulary(model: Any) -> Vocabulary | None:
    """The token ids `model` accepts (its input embedding's rows, its LM head's logits), read
    before sharding; None when the model exposes no embedding table."""
    hf = hf_model(model)
    embed = hf.get_input_embeddings() if hasattr(hf, "get_input_embeddings") else None
    rows = getattr(embed, "num_embeddings", None)
    if not isinstance(rows, int):
        return None
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    logits = getattr(head, "out_features", None)
    return Vocabulary(embedding_rows=rows, logits=logits if isinstance(logits, int) else rows)


def shard_model(model: Any, world_mesh: SPMesh, *, bf16: bool, param_offload: bool) -> None:
    """FSDP2 over the whole DP × SP world (`fsdp_plan`, sum reduction); every trainable
    parameter must end up a DTensor."""
    from torch.distributed.tensor import DTensor

    fsdp_plan(model, world_mesh, mixed_precision="bf16" if bf16 else "fp32", param_offload=param_offload).apply(model)
    loose = [n for n, p in model.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
    if loose:
        raise ValueError(f"trainable parameters outside FSDP after fsdp_plan: {loose[:4]}")
