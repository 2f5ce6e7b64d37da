"""What `LongContextTrainerMixin.__init__` checks and builds before and after
`Trainer.__init__`: the keyword arguments of the mixin, the patched model and its mesh, the
collators of the step DataLoader, and the FSDP2 sharding of the model.

Where it sits: construction of the Trainer path (`training/trainer.py`), before any step;
every check here runs on every rank alike and before any collective (a rank that raised
alone would leave the others waiting). The refusals of `TrainingArguments` / `Trainer`
parameters are `checks.py` / `arguments.py`.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

from hf_longctx._compat import checkpointing_fields
from hf_longctx.data.collator import LongContextCollator
from hf_longctx.data.cost import CostModel, GroupCost
from hf_longctx.data.token_ids import Vocabulary
from hf_longctx.distributed.flex.bank import GroupBank
from hf_longctx.distributed.flex.collator import FlexCollator
from hf_longctx.integrations.accelerate import fsdp_plan
from hf_longctx.integrations.transformers import is_patched, patch_state
from hf_longctx.model_walk import hf_model
from hf_longctx.training.checks import check_world


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_options(mesh: Any, unequal_calls: Any, sync_each_microbatch: Any, param_offload: Any) -> None:
    """The three bool keyword arguments and the combinations that cannot run."""
    flag("unequal_calls", unequal_calls)
    if unequal_calls and not isinstance(mesh, GroupBank):
        raise ValueError(
            "unequal_calls=True needs a GroupBank (flexible SP groups planned by plan_unequal); with an SPMesh "
            "every rank runs the same number of micro-batches"
        )
    flag("sync_each_microbatch", sync_each_microbatch)
    if sync_each_microbatch and unequal_calls:
        raise ValueError("sync_each_microbatch=True cannot be combined with unequal_calls=True: with unequal counts "
                         "every rank syncs in its own last backward")
    flag("param_offload", param_offload)
    if param_offload and unequal_calls:
        raise ValueError("param_offload=True cannot be combined with unequal_calls=True: the unequal-count step "
                         "keeps the model unsharded on the device for the whole step; use equal counts")


def check_caps(mesh: Any, max_tokens: Any, max_tokens_per_rank: Any, cost: Any, strategy: str) -> None:
    if isinstance(mesh, GroupBank):
        if max_tokens is not None:
            raise ValueError(
                f"max_tokens={max_tokens!r} with a GroupBank: groups differ in size, so the cap is per rank; pass "
                "max_tokens_per_rank (a group of size s packs at most s × max_tokens_per_rank tokens)"
            )
        positive_int("max_tokens_per_rank", max_tokens_per_rank)
        if cost is not None and not isinstance(cost, (GroupCost, CostModel)):
            raise ValueError(f"cost must be a GroupCost (or a CostModel split over the sizes), got {type(cost).__name__}")
        if strategy != "balanced":
            raise ValueError(
                f"strategy={strategy!r} picks a fixed-degree planner; a GroupBank plans every step with "
                "plan_flexible (use an SPMesh to run the fixed-degree strategies)"
            )
    else:
        if max_tokens_per_rank is not None:
            raise ValueError("max_tokens_per_rank is the cap of a GroupBank; with an SPMesh pass max_tokens")
        positive_int("max_tokens", max_tokens)
        if cost is not None and not isinstance(cost, CostModel):
            raise ValueError(f"cost must be a CostModel with an SPMesh, got {type(cost).__name__}")


def largest_piece(mesh: Any, max_tokens: int | None, max_tokens_per_rank: int | None) -> int:
    """The longest document one micro-batch holds (what `overlong` compares against)."""
    if not isinstance(mesh, GroupBank):
        return max_tokens
    shape = mesh.shape(mesh.max_size)
    return shape.capacity(max_tokens_per_rank) // shape.doc_multiple * shape.doc_multiple


def check_patched(model: Any, mesh: Any) -> None:
    if model is None or isinstance(model, str):
        raise ValueError("pass a model instance patched with hf_longctx.patch(model, mesh), not a name or None")
    if not is_patched(model):
        raise ValueError(
            f"{type(model).__name__} is not patched: call hf_longctx.patch(model, mesh) before building the trainer "
            "(the unpatched model would attend across shards and ranks wrongly)"
        )
    state = patch_state(model)
    if isinstance(mesh, GroupBank):
        if state.bank != mesh:
            raise ValueError("the model was not patched with the trainer's GroupBank: call patch(model, bank)")
    elif state.bank is not None or state.mesh != mesh:
        raise ValueError("the model was patched with a different mesh than the trainer's `mesh`")


def check_mesh_world(mesh: Any) -> None:
    check_world(mesh.world.world_size if isinstance(mesh, GroupBank) else mesh.world_size)


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
    from hf_longctx.integrations.transformers import patch

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
        knobs = {k: getattr(state.options, k) for k in ("kv_offload", "mlp_chunks", "loss_chunks")}
        patch(model, state.bank or state.mesh, **knobs, checkpoint=True, mixers=state.mixers_option)
    mapped = copy.copy(args)  # the Trainer reads (and may write) its own copy
    for f in fields:
        setattr(mapped, f, False)
    return mapped


def with_argument(args: tuple, kwargs: dict, names: tuple[str, ...], name: str, value: Any) -> tuple[tuple, dict]:
    """(args, kwargs) of a constructor call with parameter `name` (positional order `names`)
    replaced by `value`, wherever the caller passed it."""
    if name in kwargs:
        return args, {**kwargs, name: value}
    at = names.index(name)
    if at < len(args):
        return (*args[:at], value, *args[at + 1 :]), kwargs
    return args, kwargs


def pad_id(processing_class: Any, pad_token_id: int | None) -> int:
    """`pad_token_id` if given, else the processing class's pad, else its EOS, else 0."""
    if pad_token_id is not None:
        return pad_token_id
    tok = getattr(processing_class, "tokenizer", processing_class)
    for attr in ("pad_token_id", "eos_token_id"):
        if isinstance(getattr(tok, attr, None), int):
            return getattr(tok, attr)
    return 0


def vision_collator(mesh: Any, model: Any, *, max_tokens: int, cost: Any, vision_cost: Any, strategy: str,
                    overlong: str, seed: int, pad_token_id: int) -> Any:
    """The `MultimodalCollator` of an image-text-to-text model patched with an exact vision
    family (`patch_state(model).vision`), or None for a text-only model."""
    from hf_longctx.model_walk import hf_model

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

    return MultimodalCollator(mesh, max_tokens, family.spec(hf_model(model)), cost, vision_cost, strategy=strategy,
                              overlong=overlong, seed=seed, pad_token_id=pad_token_id)


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


def build_collators(
    mesh: Any, *, max_tokens: int, max_tokens_per_rank: int | None, cost: Any, flops_model: CostModel | None,
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


def shard_model(model: Any, world_mesh: Any, *, bf16: bool, param_offload: bool) -> None:
    """FSDP2 over the whole DP × SP world (`fsdp_plan`, sum reduction); every trainable
    parameter must end up a DTensor."""
    from torch.distributed.tensor import DTensor

    fsdp_plan(model, world_mesh, mixed_precision="bf16" if bf16 else "fp32", param_offload=param_offload).apply(model)
    loose = [n for n, p in model.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
    if loose:
        raise ValueError(f"trainable parameters outside FSDP after fsdp_plan: {loose[:4]}")
