"""One packed batch -> the shard of one sequence-parallel rank, and back.

Where it sits: between the collator (or the user's loop) and `model(**shard)`; the data
half of DESIGN invariants 1-6: labels shifted per document on the FULL sequence before
sharding; one permutation (`SPMesh.local_indices`: zigzag over the ring, contiguous over
Ulysses, rank-ordinal FPDT chunks; USP Algorithms 1-2, FPDT Figure 6) gathers every
per-token tensor; positions stay global per document; documents padded at their end to
`mesh.doc_multiple` and the total to `mesh.seq_multiple` (padding: its own document, label
-100); `num_items_in_batch` identical on every rank. The shard carries ONE metadata entry
(`SP_METADATA_KEY`): the global document boundaries the patched attention builds its mask
from. Pure tensor code; the inverse (an all-gather) is `distributed/gather.py`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from hf_longctx.devices import upload_stacked


SP_METADATA_KEY = "sp_batch"  # the one kwarg that carries global document metadata to our attention
IGNORE_INDEX = -100
_CONSUMED = {"attention_mask", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"}
_FINGERPRINT_MOD = 2_147_483_647  # 2^31 - 1: products of two residues stay far below 2^63


@dataclass(frozen=True)
class SPBatchInfo:
    """Global metadata of one sharded batch, identical on every rank of the SP group.

    cu_seqlens: padded global document boundaries of ONE row; the last document may be the
        trailing padding document. For B > 1 (one document per row) it is (0, S_pad).
    source_cu_seqlens: the same documents before padding (the user's batch).
    rows: B.
    fingerprint: checksum of the user's input_ids and boundaries; the patched model compares
        it across the SP group so that SP ranks fed different samples fail loudly.
    group: (size, index) of the aligned SP group the batch was laid out for -- ranks
        [index·size, (index+1)·size) -- so that a model patched with a `GroupBank` runs its
        attention (and any recomputation of it) on that group; None for metadata built by
        hand (the patch-time mesh is used).
    device_cache: device tensors derived from this metadata, built on first use and kept for
        the batch's lifetime (`distributed/doc_sums.py`'s document ids: one upload per
        micro-batch); an attribute, not a field: never compared, and empty in a copy made by
        `dataclasses.replace` (a copy with other boundaries never sees stale ids), which tools
        that rebuild dataclasses field by field do (FSDP2's input cast,
        `torch.distributed.utils._apply_to_tensors`, replaces with every field).
    """

    cu_seqlens: tuple[int, ...]
    source_cu_seqlens: tuple[int, ...]
    rows: int
    fingerprint: int
    group: tuple[int, int] | None = None

    @property
    def device_cache(self) -> dict:
        cache = self.__dict__.get("_device_cache")
        if cache is None:
            cache = {}
            object.__setattr__(self, "_device_cache", cache)  # frozen: the cache is not metadata
        return cache

    @property
    def padded_length(self) -> int:
        return self.cu_seqlens[-1]

    def source_positions(self) -> torch.Tensor:
        """int64 [S]: where each token of the user's row sits in the padded row."""
        starts = self.cu_seqlens[: len(self.source_cu_seqlens) - 1]
        lengths = [b - a for a, b in zip(self.source_cu_seqlens[:-1], self.source_cu_seqlens[1:])]
        if not lengths:
            return torch.empty(0, dtype=torch.long)
        return torch.cat([torch.arange(s, s + n, dtype=torch.long) for s, n in zip(starts, lengths)])


def _as_tensor(name: str, value: Any) -> torch.Tensor:
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if t.dim() == 1:
        t = t[None]  # a single unbatched row
    if t.dim() != 2:
        raise ValueError(f"batch['{name}'] must be [B, S], got shape {tuple(t.shape)}")
    return t


def _boundaries(batch: Mapping[str, Any], position_ids: torch.Tensor | None, b: int, s: int) -> list[int]:
    """Document boundaries of the packed row (B = 1): HF's flash kwargs if present, else where
    position_ids do not continue by +1 (the rule HF's own packed-sequence mask uses)."""
    if batch.get("cu_seq_lens_q") is not None:
        if b != 1:
            raise ValueError(f"cu_seq_lens_q describes one packed row, but the batch has B = {b} rows")
        cu = [int(x) for x in torch.as_tensor(batch["cu_seq_lens_q"]).flatten()]
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != s or any(y <= x for x, y in zip(cu[:-1], cu[1:])):
            raise ValueError(f"cu_seq_lens_q must rise strictly from 0 to S = {s}, got {cu[:8]}...")
        return cu
    if position_ids is None:
        return [0, s]
    restarts = (position_ids[:, 1:] != position_ids[:, :-1] + 1)  # [B, S-1]
    if b > 1:
        if bool(restarts.any()):
            rows = sorted({int(r) for r in restarts.nonzero()[:, 0]})
            raise ValueError(
                f"rows {rows[:8]} hold several documents (position_ids restart) but B = {b}: packed documents "
                "must come as ONE row (B = 1), e.g. from DataCollatorWithFlattening(return_position_ids=True)"
            )
        return [0, s]
    starts = (restarts[0].nonzero()[:, 0] + 1).tolist()
    return [0, *starts, s]


def _check_padding(mask: torch.Tensor, labels: torch.Tensor | None) -> None:
    """attention_mask may only mark a right-padded tail of each row: under causal attention no
    real token sees it, exactly as with HF's mask. Anything else cannot be reproduced."""
    m = mask.to(torch.int64)
    if bool((m[:, 1:] > m[:, :-1]).any()):
        raise ValueError(
            "attention_mask has zeros before ones (left padding or holes); sequence parallelism needs right "
            "padding or, better, packed documents from DataCollatorWithFlattening(return_position_ids=True)"
        )
    if labels is not None and bool(((m == 0) & (labels != IGNORE_INDEX)).any()):
        raise ValueError("labels at positions with attention_mask == 0 must be -100; set them to -100 before shard_batch")


def _shift(labels: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """[B, S] unshifted HF labels -> [B, S] targets: token t predicts label t+1 of its own document."""
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    ends = torch.tensor(cu[1:], dtype=torch.long) - 1
    shifted[:, ends] = IGNORE_INDEX  # the last token of each document has no target
    return shifted


def _pad_plan(cu: list[int], position_ids: torch.Tensor, dm: int, sm: int, b: int):
    """Where every padded token comes from.

    Returns (padded_cu, src [S_pad] source index or -1, pad_pos [B, S_pad] positions of pads).
    Pads of a document continue its positions; the trailing padding document counts from 0.
    """
    src_parts, pos_parts, padded = [], [], [0]
    for a, e in zip(cu[:-1], cu[1:]):
        n = e - a
        extra = (-n) % dm
        src_parts.append(torch.cat([torch.arange(a, e), torch.full((extra,), -1)]))
        pos_parts.append(torch.cat([position_ids[:, a:e], position_ids[:, e - 1 : e] + torch.arange(1, extra + 1)], 1))
        padded.append(padded[-1] + n + extra)
    tail = (-padded[-1]) % sm
    if tail:
        if b > 1:  # one document per row: the row's own document absorbs the padding
            src_parts.append(torch.full((tail,), -1))
            pos_parts.append(pos_parts[-1][:, -1:] + torch.arange(1, tail + 1))
            padded[-1] += tail
        else:
            src_parts.append(torch.full((tail,), -1))
            pos_parts.append(torch.arange(tail).expand(b, tail))
            padded.append(padded[-1] + tail)
    return padded, torch.cat(src_parts).long(), torch.cat(pos_parts, 1).long()


def _fingerprint(input_ids: torch.Tensor, cu: list[int]) -> int:
    ids = input_ids.flatten().long() % _FINGERPRINT_MOD
    weights = torch.arange(1, ids.numel() + 1, dtype=torch.long) % 65521 + 1
    value = int(((ids * weights) % _FINGERPRINT_MOD).sum()) % _FINGERPRINT_MOD
    for i, c in enumerate(cu):
        value = (value * 31 + c * (i + 7)) % _FINGERPRINT_MOD
    return value


def _host_inputs(batch: Mapping[str, Any], device) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.device]:
    """The batch's `input_ids` [B, S] and its other per-token [B, S] tensors, on the host, and
    the device the shard goes to (default: the batch's). Raises ValueError on a batch that is
    no mapping with [B, S] `input_ids`, an empty one, or an entry that is no per-token tensor."""
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise ValueError(f"batch must be a mapping with 'input_ids', got {type(batch).__name__} with keys {list(batch)[:8] if isinstance(batch, Mapping) else '-'}")
    input_ids = _as_tensor("input_ids", batch["input_ids"])
    # The layout math runs on CPU (small integer tensors, no device syncs per index); the
    # shard goes back to the device the batch came from.
    device = input_ids.device if device is None else torch.device(device)
    input_ids = input_ids.cpu()
    b, s = input_ids.shape
    if s == 0:
        raise ValueError("batch['input_ids'] is empty")
    per_token: dict[str, torch.Tensor] = {}
    for key, value in batch.items():
        if key in _CONSUMED or key in ("input_ids", "num_items_in_batch") or value is None:
            continue
        t = _as_tensor(key, value) if isinstance(value, torch.Tensor) or key in ("labels", "position_ids") else None
        if t is None or t.shape != (b, s):
            raise ValueError(
                f"batch['{key}'] is not a per-token [B={b}, S={s}] tensor (got {type(value).__name__}"
                f"{'' if t is None else ' of shape ' + str(tuple(t.shape))}); shard_batch cannot place it on a rank -- "
                "drop it from the batch or pass it to the model yourself"
            )
        per_token[key] = t.cpu()
    return input_ids, per_token, device


def _padded_row(
    input_ids: torch.Tensor, position_ids: torch.Tensor, per_token: dict[str, torch.Tensor],
    labels: torch.Tensor | None, cu: list[int], mesh, pad_token_id: int,
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """The padded global boundaries and every per-token tensor on the padded row [B, S_pad]:
    `input_ids` (pads: `pad_token_id`), `position_ids` (pads continue their document's), the
    other per-token tensors (pads: 0) and, with labels, `shift_labels` (pads: -100)."""
    padded_cu, src, pad_pos = _pad_plan(cu, position_ids.long(), mesh.doc_multiple, mesh.seq_multiple, input_ids.shape[0])
    keep = src >= 0
    src_idx = src.clamp_min(0)

    def place(t: torch.Tensor, fill: int) -> torch.Tensor:
        out = t[:, src_idx]  # [B, S_pad]
        out[:, ~keep] = fill
        return out

    full = {"input_ids": place(input_ids, pad_token_id), "position_ids": torch.where(keep, place(position_ids.long(), 0), pad_pos)}
    for key, t in per_token.items():
        full[key] = place(t, 0)
    if labels is not None:
        full["shift_labels"] = place(_shift(labels.long(), cu), IGNORE_INDEX)
    return padded_cu, full


def _num_items(shift_labels: torch.Tensor, num_items_in_batch: int | torch.Tensor | None) -> int:
    """`num_items_in_batch` as a positive int; None: the valid targets of `shift_labels`.
    Raises ValueError naming the value (and a batch whose every label is -100)."""
    count = int((shift_labels != IGNORE_INDEX).sum())
    if num_items_in_batch is None:
        num_items_in_batch = count
    n = int(num_items_in_batch)
    if n < 1 or n != num_items_in_batch:
        raise ValueError(
            f"num_items_in_batch must be a positive int (valid targets of the step), got {num_items_in_batch!r}"
            + ("; this batch has no valid label after shifting -- every label is -100" if count == 0 else "")
        )
    return n


def shard_batch(
    batch: Mapping[str, Any], mesh, num_items_in_batch: int | torch.Tensor | None = None, *, pad_token_id: int = 0,
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """The shard of THIS SP rank: exactly the kwargs of `model(**shard)`.

    Labels are shifted per document on the whole row before sharding; one permutation of
    the SP rank gathers every per-token tensor. Other [B, S] tensors of `batch` (loss
    weights, token_type_ids) are padded with 0 and sharded too.

    Args:
        batch: A packed row as `DataCollatorWithFlattening(return_position_ids=True)` makes
            it (`input_ids`, HF-unshifted `labels`, `position_ids` restarting per document;
            B = 1), or a plain [B, S] batch with one document per row (optional
            right-padding `attention_mask`).
        mesh (SPMesh): This rank's mesh.
        num_items_in_batch: Valid targets of the whole step (all DP ranks, all
            micro-batches; default: the valid targets of this batch).
        pad_token_id: The id of the padding the layout adds.
        device: Where the shard goes (default: the batch's device). The layout runs on the
            host; pass the batch as it comes from the data pipeline (host tensors) with
            `device=...`, so that the only copy is the shard's, one pinned non-blocking copy
            per dtype: a batch already on the GPU is first copied back to the host (a
            blocking copy).

    Returns:
        `input_ids`, `position_ids` [B, S_local]; with labels also `labels` and
            `shift_labels` (both the pre-shifted targets) and `num_items_in_batch`; and
            `SP_METADATA_KEY` -> `SPBatchInfo`. The same on every rank except the per-token
            tensors.

    Raises:
        ValueError: Unusable input (before any collective), naming what is wrong.
    """
    input_ids, per_token, device = _host_inputs(batch, device)
    b, s = input_ids.shape
    if num_items_in_batch is None:
        num_items_in_batch = batch.get("num_items_in_batch")
    labels = per_token.pop("labels", None)
    position_ids = per_token.pop("position_ids", None)
    cu = _boundaries(batch, position_ids, b, s)
    if position_ids is None:
        position_ids = torch.arange(s, dtype=torch.long).expand(b, s)
    if batch.get("attention_mask") is not None:
        _check_padding(_as_tensor("attention_mask", batch["attention_mask"]).cpu(), labels)

    padded_cu, full = _padded_row(input_ids, position_ids, per_token, labels, cu, mesh, pad_token_id)
    if labels is not None:
        num_items_in_batch = _num_items(full["shift_labels"], num_items_in_batch)
    elif num_items_in_batch is not None:
        raise ValueError(f"num_items_in_batch={num_items_in_batch!r} given but the batch has no 'labels'")

    row_cu = padded_cu if b == 1 else [0, padded_cu[-1]]
    idx = mesh.local_indices(row_cu)  # [S_local] global positions this rank holds
    # [B, S_local] each, on the device without blocking the host: one pinned non_blocking copy per dtype
    shard: dict[str, Any] = upload_stacked({key: t[:, idx] for key, t in full.items()}, device)
    if labels is not None:
        shard["labels"] = shard["shift_labels"]  # pre-shifted: HF's loss uses shift_labels, labels only switch it on
        shard["num_items_in_batch"] = num_items_in_batch
    shard[SP_METADATA_KEY] = SPBatchInfo(
        cu_seqlens=tuple(row_cu),
        source_cu_seqlens=tuple(cu) if b == 1 else (0, s),
        rows=b,
        fingerprint=_fingerprint(input_ids, cu),
        group=(mesh.sp, mesh.dp_rank),  # aligned: global rank = dp_rank·sp + sp_rank (distributed/mesh.py)
    )
    return shard
