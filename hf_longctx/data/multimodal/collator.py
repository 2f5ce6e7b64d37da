"""The multimodal step collator: documents with their images and videos -> THIS rank's shards.

Where it sits: the vision-language counterpart of `data/collator.LongContextCollator`,
after the step sampler and before `model(**micro_batch)`. Each feature is ONE document as
the model's processor makes it. It checks every document's images against its
placeholders (`items.read_row`), masks their labels, plans the step with
`plan_microbatches` where a document costs its language-model time T(l) plus its encoder
work (a·p² + b·p per image or video slice) shared by the SP group, packs each micro-batch
with its images in order and hands it to `shard_multimodal`.
Guarantees: an image is never cut (a document with images over the token cap is refused);
`num_items_in_batch` is the step's global count of valid targets (invariant 6)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from hf_longctx.data.collator import check_feature_options, read_documents, require_targets
from hf_longctx.data.cost import CostModel, DEFAULT_COST
from hf_longctx.data.multimodal.documents import check_one_document, resolve_spec
from hf_longctx.data.multimodal.items import RowVision, read_row
from hf_longctx.data.multimodal.sharding import shard_multimodal
from hf_longctx.data.multimodal.spec import VisionCost, VisionSpec
from hf_longctx.data.packing import Plan, plan_microbatches
from hf_longctx.data.sharding import IGNORE_INDEX

_SQUEEZE = ("input_ids", "attention_mask", "mm_token_type_ids")


@dataclass(frozen=True)
class _Doc:
    ids: torch.Tensor  # [L]
    labels: torch.Tensor  # [L] unshifted, -100 at placeholders
    vision: dict  # the document's pixel / grid / per-item tensors
    items: RowVision
    encoder_cost: float


def _one_document(i: int, feat: Mapping[str, Any], label_keys: Sequence[str]) -> dict:
    """A processor's output for one document, with its per-token [1, L] rows as [L]."""
    out = dict(feat)
    for key in (*_SQUEEZE, *label_keys):
        value = out.get(key)
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[0] == 1:
            out[key] = value[0]
        elif isinstance(value, torch.Tensor) and value.dim() == 2:
            raise ValueError(f"feature {i}: '{key}' has shape {tuple(value.shape)}; pass ONE document per feature")
    mask = out.pop("attention_mask", None)
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        raise ValueError(f"feature {i}: attention_mask has zeros; process each document alone (no padding)")
    return out


class MultimodalCollator:
    """`collator(features)` -> this rank's micro-batches of a vision-language model.

    Every rank calls it with the step's global list of documents; each feature is ONE
    document (one that visibly holds several is refused). `cost` and `vision_cost` must share
    a unit: both default to the model's FLOPs (`spec.text_cost`, `spec.cost`); pass both to
    use fitted times.

    Args:
        mesh: This rank's `SPMesh`.
        max_tokens: Tokens one SP group holds per micro-batch, image tokens and padding
            included.
        spec: `hf_longctx.vision_spec(model)`, or None with the patched `model=` (patch()
            remembers its spec; both given: they must agree).
        cost: The language model's per-document cost T(l).
        vision_cost: The encoder's work per image / video slice.
        model: The patched model, whose spec is used when `spec` is None.
        strategy: As for `LongContextCollator`.
        overlong: As for `LongContextCollator` (text-only documents only).
        seed: As for `LongContextCollator`.
        pad_token_id: The id of padding tokens.
        label_key: The feature key of the labels (unshifted), as for `LongContextCollator`.
        loss_mask_key: The feature key of a 0/1 loss mask per token (unshifted), or None.

    Raises:
        ValueError: Only one of `cost` and `vision_cost` given, or an option out of range.
        NotSupported: The model's family is refused (no spec).
    """

    def __init__(
        self, mesh: Any, max_tokens: int, spec: VisionSpec | None = None, cost: CostModel | None = None,
        vision_cost: VisionCost | None = None, *, model: Any = None, strategy: str = "balanced", overlong: str = "error",
        seed: int = 0, pad_token_id: int = 0, label_key: str = "labels", loss_mask_key: str | None = None,
    ) -> None:
        spec = resolve_spec(spec, model, "MultimodalCollator")
        if (cost is None) != (vision_cost is None):
            raise ValueError(
                "cost and vision_cost must be given together: the two share a unit (e.g. seconds from your own profile); "
                "pass both (vision_cost=VisionCost(a, b)), or neither (both then count the model's FLOPs)"
            )
        check_feature_options(pad_token_id, label_key, loss_mask_key)
        self.mesh, self.max_tokens, self.spec = mesh, max_tokens, spec
        self.cost = cost or spec.text_cost or DEFAULT_COST
        self.vision_cost = vision_cost or spec.cost
        self.strategy, self.overlong, self.seed = strategy, overlong, seed
        self.pad_token_id, self.label_key, self.loss_mask_key = pad_token_id, label_key, loss_mask_key
        self.last_plan: Plan | None = None
        self.last_num_items: int | None = None
        self.last_encoder_flops = 0.0  # the step's encoder work (every rank's), in the unit of vision_cost
        self._plan([], [])  # a bad planner argument fails here, not at the first step

    @property
    def columns(self) -> tuple[str, ...]:
        """The dataset columns this collator reads (the step DataLoader fetches these)."""
        refused = [key for key, _ in self.spec.refused_keys]  # read only to refuse them (never dropped unseen)
        return ("input_ids", self.label_key, *([self.loss_mask_key] if self.loss_mask_key else []),
                *sorted(self.spec.input_keys), *refused)

    @property
    def stats(self) -> dict[str, float] | None:
        """Balance of the last step's plan under the language-model cost (`Plan.stats`), its global
        target count and encoder work, for logging; None before the first call."""
        if self.last_plan is None:
            return None
        return {**self.last_plan.stats(self.cost), "num_items_in_batch": self.last_num_items,
                "encoder_flops": self.last_encoder_flops}

    def _documents(self, features: Sequence[Mapping[str, Any]]) -> list[_Doc]:
        keys = sorted(self.spec.input_keys)
        if isinstance(features, Mapping) or not isinstance(features, Sequence) or not features:
            raise ValueError(f"features must be a non-empty list of per-document mappings, got {type(features).__name__}")
        label_keys = [k for k in (self.label_key, self.loss_mask_key) if k]
        feats = [_one_document(i, f, label_keys) if isinstance(f, Mapping) else f for i, f in enumerate(features)]
        texts = read_documents(feats, label_key=self.label_key, loss_mask_key=self.loss_mask_key)
        docs = []
        for i, feat in enumerate(feats):
            for key, why in self.spec.refused_keys:
                if feat.get(key) is not None and bool(torch.as_tensor(feat[key]).ne(0).any()):
                    raise ValueError(f"feature {i}: '{key}' is set: {why}")
        for i, (feat, (ids, labels)) in enumerate(zip(feats, texts)):
            check_one_document(ids, self.spec, f"feature {i} ({len(ids)} tokens)", "pass each document as a feature "
                               "of its own (the collator packs them, with positions restarting per document)")
            vision = {k: feat[k] for k in keys if feat.get(k) is not None and k != "mm_token_type_ids"}
            try:
                items = read_row(vision, ids, [0, len(ids)], self.spec)
            except ValueError as e:
                raise ValueError(f"feature {i}: {e}") from None
            labels = labels.clone()
            for m in self.spec.modalities:
                labels[ids == m.token_id] = IGNORE_INDEX
            work = sum(self.vision_cost(u.patches) for u in items.units)
            docs.append(_Doc(ids, labels, vision, items, work))
        cap = self.max_tokens
        long = [(i, len(d.ids)) for i, d in enumerate(docs) if not d.items.empty and len(d.ids) > cap]
        if long:
            raise ValueError(
                f"documents with images longer than the token cap max_tokens={cap}: (index, tokens) {long[:8]}; an image is "
                "never cut, so raise max_tokens (image tokens count), downscale the images in the processor "
                "(max_pixels), or drop these documents"
            )
        return docs

    def _plan(self, lengths: Sequence[int], extra: Sequence[float]) -> Plan:
        return plan_microbatches(
            lengths, dp_size=self.mesh.dp, max_tokens=self.max_tokens, cost=self.cost, seed=self.seed,
            strategy=self.strategy, overlong=self.overlong, doc_multiple=self.mesh.doc_multiple,
            seq_multiple=self.mesh.seq_multiple, extra_costs=list(extra),
        )

    def plan(self, features: Sequence[Mapping[str, Any]]) -> Plan:
        """The plan of this step (the same on every rank); `plan[mesh.dp_rank]` is ours."""
        docs = self._documents(features)
        return self._plan([len(d.ids) for d in docs], [d.encoder_cost / self.mesh.sp for d in docs])

    def _pack(self, docs: list[_Doc], plan: Plan, piece_ids: list[int]) -> dict:
        if not piece_ids:  # an empty slot: one padding document, so this rank joins every collective
            return {"input_ids": torch.tensor([[self.pad_token_id]]), "labels": torch.tensor([[IGNORE_INDEX]]),
                    "position_ids": torch.tensor([[0]])}
        pieces = [plan.pieces[p] for p in piece_ids]
        out = {
            "input_ids": torch.cat([docs[p.doc].ids[p.start:p.end] for p in pieces])[None],  # [1, S]
            "labels": torch.cat([docs[p.doc].labels[p.start:p.end] for p in pieces])[None],  # [1, S] unshifted
            "position_ids": torch.cat([torch.arange(p.length) for p in pieces])[None],  # [1, S]
        }
        for key in self.spec.input_keys:  # a document with images is one whole piece: its items stay in order
            parts = [torch.as_tensor(docs[p.doc].vision[key]) for p in pieces if key in docs[p.doc].vision]
            if parts:
                out[key] = torch.cat(parts)
        return out

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        docs = self._documents(features)
        plan = self._plan([len(d.ids) for d in docs], [d.encoder_cost / self.mesh.sp for d in docs])
        num_items = sum(int((docs[p.doc].labels[p.start + 1:p.end] != IGNORE_INDEX).sum()) for p in plan.pieces)
        require_targets(num_items, [len(d.ids) for d in docs])
        self.last_encoder_flops = float(sum(d.encoder_cost for d in docs))
        out = [
            shard_multimodal(self._pack(docs, plan, mb), self.mesh, self.spec, num_items, pad_token_id=self.pad_token_id)
            for mb in plan[self.mesh.dp_rank]
        ]
        self.last_plan, self.last_num_items = plan, num_items
        return out
