"""The patched model's vision hook: encode this rank's share, exchange once, hand the model its rows.

Where it sits: a forward pre-hook `patch()` installs on an image-text-to-text model, fed by
the `SP_VISION_KEY` entry of `shard_multimodal`. Per micro-batch it runs the family's own
encoder (`families.py`) on the units this rank was dealt (the tower keeps its own
attention), moves every embedding row to the rank holding its placeholder in ONE
differentiable all-to-all (`distributed/vision_exchange.py`), and passes the rows as
`mm_encoder_outputs` (row i fills the modality's i-th placeholder), so the model merges them
exactly where one device would. Every modality is passed on every rank, zero rows included,
so every rank runs the exchange's backward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from hf_longctx.data.multimodal.sharding import SP_VISION_KEY, VisionShard
from hf_longctx.data.multimodal.spec import VisionSpec
from hf_longctx.distributed.vision_exchange import exchange_rows
from hf_longctx.integrations.patch_state import PatchState


@dataclass
class VisionFeatures(BaseModelOutputWithPooling):
    """`BaseModelOutputWithPooling` with the DeepStack levels the Qwen3-VL family reads."""

    deepstack_features: list | None = None


def _features(local: torch.Tensor, idx: torch.Tensor, start: int, width: int, spec: VisionSpec):
    """Rows `idx` [n] and columns [start, start + width) of `local` [n_local, F] in the family's
    container: a list of one [n, D] or a [1, n, D] tensor. Gathered by advanced indexing, never
    a view: the model returns the features in its output (`image_outputs`), where FSDP2 hooks
    its pre-backward on every output tensor, and an in-place op on a view would drop that hook."""
    cols = torch.arange(start, start + width, device=local.device)
    if spec.container == "list":
        return [local[idx[:, None], cols[None, :]]]  # [n, D]
    return local[idx[None, :, None], cols[None, None, :]]  # [1, n, D]


def encoder_parameters(hf) -> list:
    """The parameters the encoder call uses: everything outside the language model (its decoder,
    with the input embeddings) and the LM head -- the vision tower and the projector."""
    lm = {id(p) for p in hf.get_decoder().parameters()}
    head = hf.get_output_embeddings()
    lm |= {id(p) for p in (head.parameters() if head is not None else [])}
    return [p for p in hf.parameters() if id(p) not in lm]


def encode_and_exchange(
    hf, family: Any, spec: VisionSpec, shard: VisionShard, group, trainable: bool
) -> dict[str, VisionFeatures]:
    """`mm_encoder_outputs` of this rank for one micro-batch (see the module docstring).
    `trainable`: the exchange carries gradients -- decided alike on every rank (grad mode and
    whether any encoder parameter trains), never by whether this rank happened to encode
    something, so every rank runs the exchange's backward or none does."""
    emb = hf.get_input_embeddings().weight
    width = spec.hidden * (1 + spec.deepstack)  # F: pooled rows + DeepStack levels as columns
    parts = []
    for m, inputs, expected in zip(spec.modalities, shard.inputs, shard.own_rows):
        if inputs is None:
            continue
        device = next(hf.parameters()).device
        inputs = {k: v.to(device, non_blocking=True) for k, v in inputs.items()}
        rows, deep = family.encode(hf, m, inputs)  # [n, D], spec.deepstack x [n, D]
        if rows.shape[0] != expected or len(deep) != spec.deepstack:
            raise RuntimeError(
                f"{spec.family}: the encoder returned {rows.shape[0]} {m.name} rows and {len(deep)} DeepStack levels for "
                f"this rank's units; the plan expects {expected} and {spec.deepstack} (the adapter's token rule disagrees "
                "with this model's encoder)"
            )
        parts.append(torch.cat([rows, *deep], dim=-1).to(emb.dtype))  # [n, F]
    if parts:
        x = torch.cat(parts)  # [n_own, F] in unit order
        x = x if trainable else x.detach()
    else:  # nothing to encode here: a zero-row leaf keeps this rank in the exchange's backward
        x = torch.zeros(0, width, dtype=emb.dtype, device=emb.device, requires_grad=trainable)
    plan = shard.plan
    send = x[plan.send_index.to(x.device)]  # [n_send, F] grouped by destination
    got = exchange_rows(send, plan.send_counts, plan.recv_counts, group)  # [n_local, F] grouped by source
    local = got[plan.recv_order.to(got.device)]  # [n_local, F] in this shard's order
    modality = plan.local_modality.to(got.device)
    out = {}
    for mi, m in enumerate(spec.modalities):
        if not shard.present[mi]:
            continue
        idx = (modality == mi).nonzero().flatten()  # [n_m]: this modality's placeholders, in local order
        out[m.name] = VisionFeatures(
            pooler_output=_features(local, idx, 0, spec.hidden, spec),
            deepstack_features=[_features(local, idx, spec.hidden * (j + 1), spec.hidden, spec)
                                for j in range(spec.deepstack)] if spec.deepstack else None,
        )
    return out


def make_vision_hook(state: PatchState, hf, family: Any, spec: VisionSpec):
    """The pre-forward hook `patch()` registers (first) on an image-text-to-text model."""
    from hf_longctx.data.sharding import SP_METADATA_KEY
    from hf_longctx.integrations.attention import batch_mesh

    raw = sorted(spec.input_keys - {"mm_token_type_ids"})

    def hook(module, args, kwargs):
        vision = kwargs.pop(SP_VISION_KEY, None)
        given = [k for k in raw if kwargs.get(k) is not None]
        if given:
            raise ValueError(
                f"the patched {spec.family} model got {given} directly: under sequence parallelism the images are "
                "encoded by the rank they were dealt to and routed to the shards holding their tokens; pass the batch "
                "through hf_longctx.shard_multimodal(batch, mesh, model=model) and call model(**shard)"
            )
        if vision is None:
            return args, kwargs  # a text-only micro-batch
        if not isinstance(vision, VisionShard) or vision.family != spec.family:
            raise ValueError(f"'{SP_VISION_KEY}' must come from shard_multimodal with this model's vision_spec ({spec.family})")
        info = kwargs.get(SP_METADATA_KEY)
        mesh = batch_mesh(state, info) if info is not None else state.mesh
        # read per call: adapters (PEFT) may be added or frozen after patch()
        trainable = torch.is_grad_enabled() and any(p.requires_grad for p in encoder_parameters(hf))
        kwargs["mm_encoder_outputs"] = encode_and_exchange(hf, family, spec, vision, mesh.sp_group, trainable)
        return args, kwargs

    return hook
