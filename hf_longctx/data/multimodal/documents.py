"""Which VisionSpec a data-stage call uses, and the refusal of a row that holds several
documents without saying where they start.

Where it sits: at the entry of `shard_multimodal` and of the multimodal collator, before any
collective. `resolve_spec` takes the spec as given, or the one `patch()` remembered on the
model (`PatchState.vision_spec`), and refuses the two when they disagree. A row's documents
are known from its boundaries only: `position_ids` restarting at 0, `cu_seq_lens_q`, one
document per row (with `attention_mask`) or per collator feature. Without them a row is ONE
document: its M-RoPE positions run on and its attention crosses what were several documents,
a different input from the documents one by one. `check_one_document` refuses a row that
visibly holds several: a separator token (`VisionSpec.separators`: BOS or padding, never
inside one document) between its content tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hf_longctx.data.multimodal.spec import VisionSpec
from hf_longctx.errors import NotSupported
from hf_longctx.model_walk import installed_patch


def resolve_spec(spec: Any, model: Any, where: str) -> VisionSpec:
    """`spec`, or the VisionSpec `patch()` remembered on `model`; both given must be equal."""
    if spec is not None and not isinstance(spec, VisionSpec):
        raise ValueError(f"{where}: spec must be the model's VisionSpec (hf_longctx.vision_spec(model)), got "
                         f"{type(spec).__name__}; or pass the patched model as model=")
    remembered = None
    if model is not None:
        state = installed_patch(model)  # the PatchState: its `vision_spec` is what patch() remembered
        remembered = state.vision_spec if state is not None else None
        if remembered is None:
            raise ValueError(
                f"{where}: model= ({type(model).__name__}) carries no VisionSpec: it is not patched, or has no vision "
                "tower; patch it first (hf_longctx.patch(model, mesh)), or pass spec=hf_longctx.vision_spec(model)")
    if spec is None and remembered is None:
        raise ValueError(f"{where} needs the model's VisionSpec: pass model=<the patched model> (patch() remembers it) "
                         "or spec=hf_longctx.vision_spec(model)")
    if spec is not None and remembered is not None and spec != remembered:
        differ = [f.name for f in dataclasses.fields(VisionSpec) if f.compare and getattr(spec, f.name) != getattr(remembered, f.name)]
        raise NotSupported(
            f"{where}: spec ({spec.family}) contradicts the VisionSpec patch() remembered on model= ({remembered.family}); "
            f"they differ in {differ}", "pass only model= (its own spec), or the spec of that model")
    return spec if spec is not None else remembered


def inner_separators(ids: torch.Tensor, separators: tuple[int, ...]) -> list[int]:
    """Positions in `ids` [L] of separator tokens that lie between content tokens (after the
    first non-separator, before the last): a leading BOS / left padding and trailing padding
    are not boundaries."""
    if not separators:
        return []
    sep = torch.isin(ids, torch.tensor(separators, dtype=ids.dtype))  # [L]
    content = (~sep).nonzero().flatten()
    if len(content) < 2:
        return []
    inside = sep.clone()
    inside[: int(content[0]) + 1] = False
    inside[int(content[-1]):] = False
    return inside.nonzero().flatten().tolist()


def check_one_document(ids: torch.Tensor, spec: VisionSpec, what: str, fix: str) -> None:
    """Raise NotSupported (a ValueError) when the row `ids` [L] (named `what`) holds a separator between its
    content: several documents where one is expected; `fix` says how to pass them."""
    where = inner_separators(ids, spec.separators)
    if where:
        tokens = sorted({int(ids[p]) for p in where})
        raise NotSupported(
            f"{what} holds several documents but carries no boundaries: token id(s) {tokens} ({spec.family}'s BOS / "
            f"padding, which never occur inside one document) at position(s) {where[:8]}{' ...' if len(where) > 8 else ''} "
            "between its content; as one document its positions would run on and its attention cross the documents", fix)
