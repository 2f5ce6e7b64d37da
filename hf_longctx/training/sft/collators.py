"""The collators of `LongContextTrainerMixin`'s step DataLoader: a `LongContextCollator` over an
SPMesh, a `FlexCollator` over a GroupBank, or a `MultimodalCollator` for an image-text-to-text
model.

Where it sits: construction of the SFT trainer, after `Trainer.__init__` and before the model
is sharded; every rank builds the same collators from the same arguments.
"""

from __future__ import annotations

from typing import Any

from hf_longctx.data.collator import LongContextCollator
from hf_longctx.data.cost import CostModel, GroupCost
from hf_longctx.data.token_ids import Vocabulary
from hf_longctx.distributed.mesh_protocol import Mesh
from hf_longctx.flex.bank import GroupBank
from hf_longctx.flex.collator import FlexCollator
from hf_longctx.integrations.model_patch import patch_state


def vision_collator(mesh: Mesh, model: Any, *, max_tokens: int, cost: Any, vision_cost: Any, strategy: str,
                    overlong: str, seed: int, pad_token_id: int) -> Any:
    """The `MultimodalCollator` of an image-text-to-text model patched with an exact vision
    family (`patch_state(model).vision`), or None for a text-only model."""
    family = patch_state(model).vision
    if family is None:
        if vision_cost is not None:
            raise ValueError("vision_cost= is for a vision-language model patched with image support; this model has none")
        return None
    if isinstance(mesh, GroupBank):
        from hf_longctx.errors import NotSupported

        raise NotSupported(
            "a vision-language model with a GroupBank (flexible SP groups): the trainer plans its images with "
            "the fixed-degree MultimodalCollator only",
            "pass an SPMesh from init_sequence_parallel as mesh=",
        )
    from hf_longctx.data.multimodal.collator import MultimodalCollator

    return MultimodalCollator(mesh, max_tokens, None, cost, vision_cost, model=model, strategy=strategy,
                              overlong=overlong, seed=seed, pad_token_id=pad_token_id)


def build_collators(
    mesh: Mesh, *, max_tokens: int, max_tokens_per_rank: int | None, cost: Any, flops_model: CostModel | None,
    hf_config: Any, strategy: str, overlong: str, seed: int, pad_token_id: int, unequal_calls: bool,
    vision: Any = None, vocab: Vocabulary | None = None,
) -> tuple[Any, Any]:
    """(train collator, eval collator) of the step DataLoader: a `LongContextCollator` over an
    SPMesh, a `FlexCollator` over a GroupBank (evaluation always with equal counts), or the
    given `vision` collator (`vision_collator`) for an image-text-to-text model; the first two
    check every step's token ids against `vocab` before any collective."""
    if vision is not None:
        return vision, vision
    if isinstance(mesh, GroupBank):
        if cost is None and hf_config is None:
            raise ValueError("with a GroupBank pass cost= (a GroupCost): the model has no config to estimate it from")
        # Default: FLOPs split over each size plus its Ulysses/ring traffic (GroupCost.from_config);
        # without a communication term a bigger group would never cost more and flexibility never pays.
        cost = cost if cost is not None else GroupCost.from_config(hf_config, mesh.shapes)
        train = FlexCollator(mesh, max_tokens_per_rank, cost, overlong=overlong, pad_token_id=pad_token_id,
                             unequal_calls=unequal_calls, vocab=vocab)
        # Evaluation is forward-only under per-layer FSDP all-gathers: always equal counts.
        evaluate = train if not unequal_calls else FlexCollator(
            mesh, max_tokens_per_rank, cost, overlong=overlong, pad_token_id=pad_token_id, vocab=vocab)
        return train, evaluate
    collator = LongContextCollator(
        mesh, max_tokens, cost if cost is not None else flops_model, strategy=strategy, overlong=overlong, seed=seed,
        pad_token_id=pad_token_id, vocab=vocab,
    )
    return collator, collator
