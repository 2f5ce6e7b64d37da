"""The step collator: one step's global list of documents -> THIS rank's sharded micro-batches.

Where it sits: after the step sampler (`data/sampler.py`) has drawn the same global list
on every rank, before `model(**micro_batch)`. It chains the two data stages and adds no
layout of its own: `plan_microbatches` (`data/packing.py`; Hydraulis two-stage assignment,
FlexSP micro-batch chunking) assigns documents to DP ranks and micro-batches, the same
plan on every rank (invariant 8); each micro-batch is packed as
`DataCollatorWithFlattening(return_position_ids=True)` packs it and handed to `shard_batch`.
Guarantee (invariant 6): every micro-batch carries `num_items_in_batch` = the valid shifted
targets of the WHOLE step, counted locally, so gradients equal those of the global mean
loss however unequal the token counts of ranks and micro-batches are."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from hf_longctx.errors import NotSupported

from .cost import CostModel
from .packing import Plan, plan_microbatches
from .padding import MASK_KEY, real_span
from .sharding import IGNORE_INDEX, shard_batch
from .token_ids import Vocabulary, check_token_ids, document_name

_MESH_ATTRS = ("dp", "dp_rank", "doc_multiple", "seq_multiple", "local_indices")


def check_feature_options(pad_token_id: Any, label_key: Any, loss_mask_key: Any, vocab: Any = None) -> None:
    """The feature options every collator takes (fixed-degree and flexible), checked alike."""
    if vocab is not None and not isinstance(vocab, Vocabulary):
        raise ValueError(f"vocab must be an hf_longctx.data.token_ids.Vocabulary or None, got {type(vocab).__name__}")
    if vocab is not None and isinstance(pad_token_id, int) and pad_token_id >= vocab.embedding_rows:
        raise NotSupported(
            f"pad_token_id={pad_token_id} lies outside the model's embedding table of {vocab.embedding_rows} rows: every "
            "padding token would fail the embedding lookup",
            f"pass pad_token_id= an id below {vocab.embedding_rows} (the tokenizer's EOS id is the usual choice; padding "
            "never carries loss), or resize the embeddings to the tokenizer (model.resize_token_embeddings)",
        )
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
        raise ValueError(f"pad_token_id must be a non-negative int, got {pad_token_id!r}")
    if not isinstance(label_key, str) or not (loss_mask_key is None or isinstance(loss_mask_key, str)):
        raise ValueError(f"label_key must be a str and loss_mask_key a str or None, got {label_key!r}, {loss_mask_key!r}")


def require_targets(num_items: int, lengths: Sequence[int]) -> None:
    """A step whose documents leave no valid target after the per-document shift has no loss
    to normalise (num_items_in_batch = 0): refuse it, naming the lengths."""
    if num_items == 0:
        raise NotSupported(
            f"the step's {len(lengths)} document(s) have no valid target after the per-document shift "
            f"(lengths {list(lengths)[:8]}): every label is -100, masked, or a document has 1 token",
            "give the documents targets (labels: the token ids where they are learned, -100 only where not; a loss "
            "mask with some 1s), or filter out the rows without any, e.g. dataset.filter(lambda row: "
            "any(label != -100 for label in row['labels'][1:]))",
        )


def read_documents(
    features: Sequence[Mapping[str, Any]], *, label_key: str = "labels", loss_mask_key: str | None = None,
    vocab: Vocabulary | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids [L], unshifted labels [L]) per feature, int64, loss mask applied, a padded
    row's pads dropped (its `attention_mask`: `data/padding.py`); the feature checks every
    collator shares (fixed-degree and flexible). With `vocab` every id and
    label is checked against the model's vocabulary (`token_ids.py`: on the host, before any
    collective, naming the document, the position and the id)."""
    if isinstance(features, Mapping) or not isinstance(features, Sequence) or not features:
        raise ValueError(
            f"features must be a non-empty list of per-document mappings, got {type(features).__name__}"
            + (" (already collated? pass the list of documents)" if isinstance(features, Mapping) else "")
        )
    docs = []
    for i, feat in enumerate(features):
        if not isinstance(feat, Mapping) or "input_ids" not in feat:
            raise ValueError(f"feature {i} must be a mapping with 'input_ids', got {type(feat).__name__}")
        where = document_name(feat, i)
        ids = _vector(where, "input_ids", feat["input_ids"])
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise NotSupported(f"{where}: input_ids must be integers (token ids), got dtype {ids.dtype}",
                               "pass the tokenizer's integer ids; a dataset column of floats: cast it with "
                               "dataset.cast_column('input_ids', datasets.Sequence(datasets.Value('int64')))")
        ids, full = ids.long(), len(ids)
        # A padded row (its attention_mask): the real tokens only, every per-token column cut alike.
        span = slice(0, full)
        if feat.get(MASK_KEY) is not None:
            span = slice(*real_span(where, _vector(where, MASK_KEY, feat[MASK_KEY], full)))
        labels = ids = ids[span]
        given = feat.get(label_key) is not None
        if given:
            labels = _vector(where, label_key, feat[label_key], full)
            if labels.dtype.is_floating_point or labels.dtype == torch.bool:  # .long() would truncate silently
                raise NotSupported(f"{where}: '{label_key}' must be integers (token ids, -100 = no loss), got dtype "
                                   f"{labels.dtype}", f"pass integer labels; a dataset column of floats: cast it with dataset.cast_column("
                                   f"'{label_key}', datasets.Sequence(datasets.Value('int64')))")
            labels = labels.long()[span]
        if vocab is not None:
            check_token_ids(ids, labels if given else None, vocab, where)
        if loss_mask_key is not None:
            if feat.get(loss_mask_key) is None:
                raise ValueError(f"{where} has no '{loss_mask_key}' (loss_mask_key); keys: {sorted(feat)[:8]}")
            mask = _vector(where, loss_mask_key, feat[loss_mask_key], full)[span]
            bad = ((mask != 0) & (mask != 1)).nonzero()
            if len(bad):
                j = int(bad[0, 0])
                raise ValueError(f"{where}: '{loss_mask_key}' must be 0/1, token {j} has {mask[j].item()!r}")
            labels = torch.where(mask.bool(), labels, IGNORE_INDEX)
        docs.append((ids, labels))
    return docs


def _vector(where: str, key: str, value: Any, length: int | None = None) -> torch.Tensor:
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if t.numel() == 0 and not isinstance(value, torch.Tensor):
        t = t.long()  # [] would be float32; let the planner name the empty document
    if t.dim() != 1:
        raise ValueError(f"{where}: '{key}' must be 1-D (one document per feature), got shape {tuple(t.shape)}")
    if length is not None and len(t) != length:
        raise ValueError(
            f"{where}: '{key}' has {len(t)} entries but input_ids has {length}; '{key}' needs one entry per input "
            "token (labels: HF's unshifted targets, -100 = no loss; a loss mask: 0/1), e.g. made in the same "
            "dataset.map() that makes input_ids -- or drop the column (the input ids are then the targets)"
        )
    return t


class LongContextCollator:
    """`collator(features)` -> this rank's micro-batches, each ready for `model(**mb)`.

    Each feature is a mapping with `input_ids` (list or 1-D tensor: one document), optional
    `features[label_key]` (HF's UNSHIFTED labels, -100 = ignored; default: the input ids)
    and, when `loss_mask_key` is given, a 0/1 mask per token in the same unshifted convention
    (0 = this token is never a target, e.g. a prompt). An `attention_mask` (a row padded at
    its right or left end) keeps the tokens with mask 1 only: the pads are not trained and not
    packed (`data/padding.py`). Other keys are ignored.

    Every rank must call it with the same global list (the step sampler's). All ranks get
    the same number of micro-batches; a slot the plan leaves empty (fewer documents than
    slots) becomes one padding document without targets, so every rank runs the same
    collectives. Sum the micro-batch losses' gradients (never divide by their number), then
    `sum_gradients(model.parameters(), mesh)` or FSDP with a sum reduction.

    Args:
        mesh: The `SPMesh` of this rank (`init_sequence_parallel`).
        max_tokens: Tokens one SP group holds in one micro-batch, padding included (each SP
            rank holds max_tokens / sp).
        cost: Passed to `plan_microbatches` (default: its `DEFAULT_COST`).
        strategy: Passed to `plan_microbatches`.
        overlong: Passed to `plan_microbatches`: `"split"` trains the pieces of a long
            document as separate documents, `"truncate"` drops its tail, `"error"` refuses it.
        seed: Passed to `plan_microbatches`.
        pad_token_id: The id of padding tokens (they never carry loss).
        label_key: The feature key of the labels.
        loss_mask_key: The feature key of a 0/1 loss mask per token, or None.
        vocab: A `token_ids.Vocabulary` (the trainers pass the model's): every id and label
            of the step is checked against it before planning, so a bad id raises on every
            rank alike, naming the document, the position and the id, instead of failing
            mid-forward on one rank.

    Raises:
        ValueError: `mesh` is not an `SPMesh`, or an option is out of range.
    """

    def __init__(
        self,
        mesh: Any,
        max_tokens: int,
        cost: CostModel | None = None,
        *,
        strategy: str = "balanced",
        overlong: str = "error",
        seed: int = 0,
        pad_token_id: int = 0,
        label_key: str = "labels",
        loss_mask_key: str | None = None,
        vocab: Vocabulary | None = None,
    ) -> None:
        missing = [a for a in _MESH_ATTRS if not hasattr(mesh, a)]
        if missing:
            raise ValueError(f"mesh must be an SPMesh (init_sequence_parallel), got {type(mesh).__name__} without {missing}")
        if not 0 <= mesh.dp_rank < mesh.dp:
            raise ValueError(f"mesh.dp_rank ({mesh.dp_rank}) must lie in [0, dp={mesh.dp})")
        check_feature_options(pad_token_id, label_key, loss_mask_key, vocab)
        self.mesh = mesh
        self.max_tokens = max_tokens
        self.cost = cost
        self.strategy = strategy
        self.overlong = overlong
        self.seed = seed
        self.pad_token_id = pad_token_id
        self.label_key = label_key
        self.loss_mask_key = loss_mask_key
        self.vocab = vocab
        self._plan_lengths([])  # a bad planner argument fails here, not at the first step
        self.last_plan: Plan | None = None
        self.last_num_items: int | None = None

    # ---- planning ------------------------------------------------------------------------
    def _plan_lengths(self, lengths: Sequence[int]) -> Plan:
        return plan_microbatches(
            lengths,
            dp_size=self.mesh.dp,
            max_tokens=self.max_tokens,
            cost=self.cost,
            seed=self.seed,
            strategy=self.strategy,
            overlong=self.overlong,
            doc_multiple=self.mesh.doc_multiple,
            seq_multiple=self.mesh.seq_multiple,
        )

    def plan(self, features: Sequence[Mapping[str, Any]]) -> Plan:
        """The plan of this step (the same on every rank); `plan[mesh.dp_rank]` is ours."""
        return self._plan_lengths([len(ids) for ids, _ in self._documents(features)])

    @property
    def stats(self) -> dict[str, float] | None:
        """Balance of the last step's plan (`Plan.stats` under `cost`) and its global target
        count, for logging; None before the first call."""
        if self.last_plan is None:
            return None
        return {**self.last_plan.stats(self.cost), "num_items_in_batch": self.last_num_items}

    # ---- features ------------------------------------------------------------------------
    def _documents(self, features: Sequence[Mapping[str, Any]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return read_documents(features, label_key=self.label_key, loss_mask_key=self.loss_mask_key, vocab=self.vocab)

    # ---- packing -------------------------------------------------------------------------
    def _pack(self, docs: list[tuple[torch.Tensor, torch.Tensor]], plan: Plan, piece_ids: list[int]) -> dict:
        """One micro-batch as DataCollatorWithFlattening(return_position_ids=True) packs it:
        [1, S] input_ids, labels (-100 at each document's first token), restarting positions."""
        if not piece_ids:
            # An empty slot: one padding token without a target; shard_batch pads it to the
            # layout multiples, so this rank still joins every collective of the step.
            return {
                "input_ids": torch.tensor([[self.pad_token_id]]),
                "labels": torch.tensor([[IGNORE_INDEX]]),
                "position_ids": torch.tensor([[0]]),
            }
        ids, labels, positions = [], [], []
        for p in piece_ids:
            piece = plan.pieces[p]
            doc_ids, doc_labels = docs[piece.doc]
            ids.append(doc_ids[piece.start : piece.end])
            # No -100 separator needed at the piece's first label: shard_batch shifts per
            # document, so no target ever crosses into the next piece.
            labels.append(doc_labels[piece.start : piece.end])
            positions.append(torch.arange(piece.length))  # a split piece is its own document
        return {
            "input_ids": torch.cat(ids)[None],  # [1, S]
            "labels": torch.cat(labels)[None],  # [1, S] unshifted
            "position_ids": torch.cat(positions)[None],  # [1, S]
        }

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        docs = self._documents(features)
        plan = self._plan_lengths([len(ids) for ids, _ in docs])
        # Valid targets of the whole step: within each piece, token t predicts label t+1
        # (shard_batch's per-document shift), so labels [start+1, end) count.
        num_items = sum(
            int((docs[p.doc][1][p.start + 1 : p.end] != IGNORE_INDEX).sum()) for p in plan.pieces
        )
        require_targets(num_items, [len(ids) for ids, _ in docs])
        out = [
            shard_batch(self._pack(docs, plan, mb), self.mesh, num_items, pad_token_id=self.pad_token_id)
            for mb in plan[self.mesh.dp_rank]
        ]
        self.last_plan, self.last_num_items = plan, num_items
        return out
