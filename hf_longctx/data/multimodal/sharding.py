"""One packed multimodal row -> the shard of one SP rank: tokens, positions and its vision work.

Where it sits: the multimodal counterpart of `data/sharding.shard_batch`, between the
processor / multimodal collator and `model(**shard)`. The text half IS `shard_batch`; this
module adds, before any collective: the row's visual items checked against the placeholders
(`items.read_row`); labels -100 on every placeholder; positions computed per document on
the whole row and gathered with the tokens' permutation (an image may straddle a shard
boundary); and the vision plan (`routing`) under `SP_VISION_KEY`, which the vision hook
(`integrations/vision/forward.py`) consumes. A [B, S] processor batch (one document per
row, right padding) is packed into one row first."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from hf_longctx.data.multimodal.documents import check_one_document, resolve_spec
from hf_longctx.data.multimodal.items import RowVision, read_row
from hf_longctx.data.multimodal.positions import row_positions
from hf_longctx.data.multimodal.routing import ExchangePlan, deal, exchange_plan, rank_indices
from hf_longctx.data.multimodal.spec import BATCH, VisionSpec
from hf_longctx.data.sharding import IGNORE_INDEX, SP_METADATA_KEY, shard_batch
from hf_longctx.devices import to_device

_SEVERAL_FIX = (
    "pass position_ids restarting at 0 at each document (transformers' DataCollatorWithFlattening(return_position_ids="
    "True) makes them) or cu_seq_lens_q, or one document per row with attention_mask (right padding), or the documents "
    "as the features of MultimodalCollator(mesh, max_tokens, model=model)")
SP_VISION_KEY = "sp_vision"  # the shard entry the patched model's vision hook consumes
_TEXT_KEYS = ("labels", "position_ids", "attention_mask", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass(frozen=True)
class VisionShard:
    """This rank's vision work for one micro-batch (identical structure on every SP rank).

    names: modality names (the `mm_encoder_outputs` keys); inputs[m]: the encoder inputs of
    this rank's own units of modality m (`pixels`, and `grid` [n, 3] for GRID layouts), or
    None; own_rows[m]: feature rows the encoder returns for them; plan: the exchange;
    local_counts[m]: placeholder tokens of modality m on this rank; loads: encoder cost per SP
    rank (the deal); units: units this rank encodes; present[m]: the micro-batch holds
    modality m at all (then every rank passes it to the model, with zero rows if need be)."""

    family: str
    names: tuple[str, ...]
    inputs: tuple[dict | None, ...]
    own_rows: tuple[int, ...]
    plan: ExchangePlan
    local_counts: tuple[int, ...]
    loads: tuple[float, ...]
    units: int
    present: tuple[bool, ...]


def _row(batch: Mapping[str, Any], key: str) -> torch.Tensor | None:
    value = batch.get(key)
    if value is None:
        return None
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    return t[None] if t.dim() == 1 else t


def _pack_rows(batch: Mapping[str, Any]) -> dict[str, Any]:
    """A [B, S] processor batch (one document per row, right padding) as one packed row."""
    ids = _row(batch, "input_ids")
    mask = _row(batch, "attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask.to(torch.long)
    if bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ValueError(
            "attention_mask has zeros before ones (left padding); pack multimodal documents with right padding "
            "(processor(..., padding_side='right')) or with MultimodalCollator"
        )
    lengths = mask.sum(1).tolist()
    out = dict(batch)
    out["input_ids"] = torch.cat([ids[b, :n] for b, n in enumerate(lengths)])[None]  # [1, S]
    labels = _row(batch, "labels")
    if labels is not None:
        out["labels"] = torch.cat([labels[b, :n] for b, n in enumerate(lengths)])[None]
    out["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None]
    for key in ("attention_mask", "mm_token_type_ids"):
        out.pop(key, None)
    return out


def _check_rows(ids: torch.Tensor, mask: torch.Tensor | None, spec: VisionSpec) -> None:
    """Each row of a batch without boundaries is one document: refuse one that holds several."""
    for b in range(ids.shape[0]):
        row = ids[b].cpu() if mask is None else ids[b].cpu()[mask[b].cpu().bool()]
        check_one_document(row, spec, f"row {b} of the batch (input_ids {tuple(ids.shape)}, no position_ids or "
                           "cu_seq_lens_q)", _SEVERAL_FIX)


def _text_positions(batch: Mapping[str, Any], spec: VisionSpec) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(text positions [1, S] or None, given M-RoPE rows [3, S] or None)."""
    pos = batch.get("position_ids")
    if pos is None:
        return None, None
    pos = pos if isinstance(pos, torch.Tensor) else torch.as_tensor(pos)
    if pos.dim() == 3:
        if pos.shape[0] != 4 or pos.shape[1] != 1:
            raise ValueError(
                f"position_ids of shape {tuple(pos.shape)}: pass [1, S] text positions restarting at each document (the "
                f"{spec.family} positions are then computed per document), or [4, 1, S] with the text row first; a "
                "[3, 1, S] M-RoPE tensor alone does not say where documents start"
            )
        return pos[0], pos[1:, 0]
    return _row(batch, "position_ids"), None


def _check_type_ids(batch: Mapping[str, Any], ids: torch.Tensor, spec: VisionSpec) -> None:
    given = _row(batch, "mm_token_type_ids")
    if given is None:
        return
    want = torch.zeros_like(ids)
    for m in spec.modalities:
        want[ids == m.token_id] = m.type_id
    if given.shape != want.shape or not torch.equal(given.long(), want):
        raise ValueError(
            "mm_token_type_ids disagrees with the placeholder tokens of input_ids (it must be 1 at image tokens, 2 at "
            "video tokens, 0 elsewhere, as the processor makes it); pass the processor's own output unchanged"
        )


def shard_multimodal(
    batch: Mapping[str, Any], mesh: Any, spec: VisionSpec | None = None,
    num_items_in_batch: int | torch.Tensor | None = None, *, model: Any = None, pad_token_id: int = 0,
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """The shard of THIS SP rank of a multimodal batch: exactly the kwargs of `model(**shard)`.

    Args:
        batch: A processor's output (input_ids, pixel / grid tensors, optional labels, mm_token_type_ids) as one
            packed row with `position_ids` restarting per document (or `cu_seq_lens_q`; B = 1), or [B, S] rows (one
            document each, right padding); a row without boundaries is one document, and one that visibly holds
            several is refused.
        mesh: This rank's `SPMesh`.
        spec: `hf_longctx.vision_spec(model)`, or None with the patched `model=` (both given: they must agree).
        num_items_in_batch: As for `shard_batch`.
        model: The patched model, whose spec (patch() remembers it) is used when `spec` is None.
        pad_token_id: As for `shard_batch`.
        device: As for `shard_batch`.

    Returns:
        `shard_batch`'s entries (input_ids, position_ids -- [4 or 3, 1, S_local] M-RoPE rows for such families --,
            labels, shift_labels, num_items_in_batch, SP_METADATA_KEY) plus `SP_VISION_KEY` -> VisionShard when the
            row holds images or video.

    Raises:
        ValueError: Input it cannot place exactly (before any collective); NotSupported: a refused family.
    """
    spec = resolve_spec(spec, model, "shard_multimodal")
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise ValueError(f"batch must be a mapping with 'input_ids', got {type(batch).__name__}")
    for key, why in spec.refused_keys:
        value = batch.get(key)
        if value is not None and bool(torch.as_tensor(value).ne(0).any()):
            raise ValueError(f"batch['{key}'] is set: {why}")
    ids = _row(batch, "input_ids")
    if batch.get("position_ids") is None and batch.get("cu_seq_lens_q") is None:
        _check_rows(ids, _row(batch, "attention_mask"), spec)
    if ids.shape[0] > 1 or batch.get("attention_mask") is not None:
        batch = _pack_rows(batch)
        ids = _row(batch, "input_ids")
    _check_type_ids(batch, ids, spec)
    ids = ids.cpu()
    s = ids.shape[1]
    text_pos, given = _text_positions(batch, spec)
    if batch.get("cu_seq_lens_q") is not None:
        cu = [int(x) for x in torch.as_tensor(batch["cu_seq_lens_q"]).flatten()]
    elif text_pos is not None:
        starts = ((text_pos[0, 1:] != text_pos[0, :-1] + 1).nonzero().flatten() + 1).tolist()
        cu = [0, *starts, s]
    else:
        cu = [0, s]
    vision = read_row(batch, ids[0], cu, spec)
    labels = _row(batch, "labels")
    if labels is not None:
        labels = labels.clone().long()
        for m in spec.modalities:
            labels[ids == m.token_id] = IGNORE_INDEX  # images carry no loss
    text = {"input_ids": ids, "position_ids": text_pos if text_pos is not None else torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])[None]}
    if labels is not None:
        text["labels"] = labels
    for key, value in batch.items():  # any other per-token tensor (loss weights) is sharded like the tokens
        if key not in text and key not in spec.input_keys and key not in _TEXT_KEYS and key != "num_items_in_batch" \
                and key not in dict(spec.refused_keys) and isinstance(value, torch.Tensor):
            text[key] = value
    if num_items_in_batch is None:
        num_items_in_batch = batch.get("num_items_in_batch")
    shard = shard_batch(text, mesh, num_items_in_batch, pad_token_id=pad_token_id, device=device)
    info = shard[SP_METADATA_KEY]
    src = info.source_positions()  # [S] padded position of every source token
    idx = mesh.local_indices(info.cu_seqlens)  # [S_local] positions this rank holds
    if spec.positions is not None:
        mrope = given if given is not None else row_positions(ids[0], cu, vision, spec)  # [3, S]
        full = torch.zeros(3, info.padded_length, dtype=torch.long)  # [3, S_pad]: pads at 0, never attended by real tokens
        full[:, src] = mrope.long()
        local = full[:, idx][:, None]  # [3, 1, S_local]
        rows = [shard["position_ids"].cpu()[None], local] if spec.text_row else [local]
        shard["position_ids"] = to_device(torch.cat(rows), shard["input_ids"].device, pin=False)  # [4|3, 1, S_local]
    if not vision.empty:
        shard[SP_VISION_KEY] = _vision_shard(vision, spec, mesh, info.cu_seqlens, src, shard["input_ids"].device)
    return shard


def _vision_shard(vision: RowVision, spec: VisionSpec, mesh: Any, cu, src: torch.Tensor, device) -> VisionShard:
    costs = [spec.cost(u.patches) for u in vision.units]
    owner = deal(costs, mesh.sp)
    loads = [0.0] * mesh.sp
    for u, r in enumerate(owner):
        loads[r] += costs[u]
    indices = rank_indices(cu, mesh.ring, mesh.ulysses, mesh.fpdt_chunks)
    positions = [src[vision.placeholders[u.modality][u.tokens[0]:u.tokens[1]]] for u in vision.units]  # [n_u] each
    me = mesh.sp_rank
    plan = exchange_plan(positions, [u.modality for u in vision.units], owner, indices, me, int(cu[-1]))
    inputs, own_rows = [], []
    for mi in range(len(spec.modalities)):
        mine = [u for u, r in zip(vision.units, owner) if r == me and u.modality == mi]
        own_rows.append(sum(u.n_tokens for u in mine))
        if not mine:
            inputs.append(None)
            continue
        pix = vision.pixels[mi]
        entry = {"pixels": torch.cat([pix[u.pixels[0]:u.pixels[1]] for u in mine])}  # GRID [Σp, C·T·P·P] / BATCH [n, C, H, W]
        if spec.layout != BATCH:
            entry["grid"] = torch.tensor([u.grid for u in mine], dtype=torch.long)  # [n, 3]
        inputs.append(to_device(entry, device))
    counts = tuple(int((plan.local_modality == mi).sum()) for mi in range(len(spec.modalities)))
    return VisionShard(
        family=spec.family, names=tuple(m.name for m in spec.modalities), inputs=tuple(inputs),
        own_rows=tuple(own_rows), plan=plan, local_counts=counts, loads=tuple(loads),
        units=sum(r == me for r in owner),
        present=tuple(any(u.modality == mi for u in vision.units) for mi in range(len(spec.modalities))),
    )
