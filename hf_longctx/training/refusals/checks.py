"""Refusals: `TrainingArguments` (and TRL `SFTConfig`) settings that would silently break the
exact-loss contract of `LongContextTrainerMixin`, or be silently ignored by it.

Where it sits: the first thing the trainer's `__init__` runs, on every rank alike and
before any collective, so a bad setting is one clear `ValueError` everywhere instead of a
hang or a wrong gradient. The contract (DESIGN invariant 6): every rank's loss is its token-
loss sum divided by the step's GLOBAL target count, micro-batch and rank gradients are
SUMMED; one optimizer step = one planned step of `tokens_per_step` tokens.
"""

from __future__ import annotations

from typing import Any

from hf_longctx.data.cost import CostModel, GroupCost
from hf_longctx.distributed.mesh_protocol import Mesh
from hf_longctx.flex.bank import GroupBank
from hf_longctx.errors import NotSupported
from hf_longctx.integrations.model_patch import is_patched, patch_state
from hf_longctx.training.refusals.sft import refused_sft_fields
from hf_longctx.training.refusals.training_arguments import refused_arguments, refused_parameters


def check_training_arguments(args: Any, trainer: str = "LongContextTrainer") -> None:
    """Raise one `NotSupported` listing every refused setting of `args` (the table of
    `refusals/training_arguments.py`, plus TRL's SFTConfig fields), each with why and what to use instead;
    `trainer`: the class the message names."""
    errors = refused_arguments(args)
    if args.n_gpu > 1:
        errors.append(
            f"n_gpu={args.n_gpu} (nn.DataParallel in one process); do instead: launch one process per device "
            "(torchrun / accelerate launch)"
        )
    errors += refused_sft_fields(args)
    if errors:
        raise NotSupported(
            f"{trainer} cannot honour these {type(args).__name__} settings:\n- " + "\n- ".join(errors),
            "change the settings listed above as each line says",
        )


def check_trainer_parameters(params: dict[str, Any]) -> None:
    """Raise one `NotSupported` for the `Trainer.__init__` parameters the mixin refuses
    (`arguments.TRAINER_PARAMETERS`), before the Trainer is built."""
    errors = refused_parameters(params)
    if errors:
        raise NotSupported("LongContextTrainer:\n- " + "\n- ".join(errors), "change the parameters listed above as each line says")


def check_process_group(args: Any) -> None:
    """TrainingArguments must see the process group the mesh was built on."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if args.world_size != world or (world > 1 and args.process_index != dist.get_rank()):
        raise ValueError(
            f"TrainingArguments see world_size={args.world_size} (process {args.process_index}) but torch.distributed "
            f"has {world} rank(s): Accelerate reads the launcher's environment (RANK, LOCAL_RANK, WORLD_SIZE, "
            "LOCAL_WORLD_SIZE); launch with torchrun / accelerate launch, or, for a process group you initialised "
            "yourself, set those variables before creating TrainingArguments (on CPU also use_cpu=True)"
        )


def check_world(mesh_world: int) -> None:
    """The mesh and torch.distributed agree on the world: a mesh built on another process group,
    or before one existed (a world of 1 on every rank, each training the whole step alone)."""
    from hf_longctx.distributed.mesh import process_group_world

    _, world = process_group_world("LongContextTrainer")  # refuses a launch with WORLD_SIZE > 1 and no group
    if mesh_world != world:
        raise NotSupported(
            f"the mesh spans {mesh_world} rank(s) but torch.distributed has {world}: the mesh was built before the "
            "process group (or on another one), so the ranks would not share the step",
            "create TrainingArguments (which initialises the process group under torchrun / accelerate launch) or call "
            "torch.distributed.init_process_group() BEFORE hf_longctx.init_sequence_parallel / init_group_bank, then "
            "patch the model with that mesh",
        )


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_options(unequal_calls: Any, sync_each_microbatch: Any, param_offload: Any) -> None:
    """The three bool keyword arguments and the combinations that cannot run."""
    flag("unequal_calls", unequal_calls)  # needs a GroupBank: check_mesh_arguments
    flag("sync_each_microbatch", sync_each_microbatch)
    if sync_each_microbatch and unequal_calls:
        raise ValueError("sync_each_microbatch=True cannot be combined with unequal_calls=True: with unequal counts "
                         "every rank syncs in its own last backward")
    flag("param_offload", param_offload)
    if param_offload and unequal_calls:
        raise ValueError("param_offload=True cannot be combined with unequal_calls=True: the unequal-count step "
                         "keeps the model unsharded on the device for the whole step; use equal counts")


def check_mesh_arguments(mesh: Mesh, max_tokens: Any, max_tokens_per_rank: Any, cost: Any, strategy: str,
                         unequal_calls: Any) -> int:
    """The arguments whose meaning depends on the trainer's mesh (the caps, the cost model, the
    planner), checked; returns the longest document one micro-batch holds (what `overlong`
    compares against). A GroupBank's cap is per rank (its groups differ in size): the largest
    group's capacity, whole documents; an SPMesh's is `max_tokens` per SP group. `unequal_calls`
    needs a bank, a fixed-degree `strategy` a mesh."""
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
        shape = mesh.shape(mesh.max_size)
        return shape.capacity(max_tokens_per_rank) // shape.doc_multiple * shape.doc_multiple
    else:
        if max_tokens_per_rank is not None:
            raise ValueError("max_tokens_per_rank is the cap of a GroupBank; with an SPMesh pass max_tokens")
        positive_int("max_tokens", max_tokens)
        if cost is not None and not isinstance(cost, CostModel):
            raise ValueError(f"cost must be a CostModel with an SPMesh, got {type(cost).__name__}")
        if flag("unequal_calls", unequal_calls):
            raise ValueError(
                "unequal_calls=True needs a GroupBank (flexible SP groups planned by plan_unequal); with an SPMesh "
                "every rank runs the same number of micro-batches"
            )
        return max_tokens


def check_patched(model: Any, mesh: Mesh) -> None:
    if model is None or isinstance(model, str):
        raise ValueError("pass a model instance patched with hf_longctx.patch(model, mesh), not a name or None")
    if not is_patched(model):
        raise ValueError(
            f"{type(model).__name__} is not patched: call hf_longctx.patch(model, mesh) before building the trainer "
            "(the unpatched model would attend across shards and ranks wrongly)"
        )
    state = patch_state(model)
    if state.bank != mesh:  # what patch() was given: the same SPMesh, or the same GroupBank
        raise ValueError(
            "the model was patched with a different mesh than the trainer's `mesh`: call patch(model, mesh) with the "
            "trainer's SPMesh or GroupBank"
        )


def check_adapters(model: Any, trainer: str) -> None:
    """A PEFT adapter with dropout (added after `patch()`, whose exactness check refuses it):
    refused naming the adapter, the field, the value and the modules."""
    from hf_longctx.integrations.adapter_dropout import adapter_dropout_problems
    from hf_longctx.model_walk import hf_model

    problems = adapter_dropout_problems(hf_model(model))
    if problems:
        raise NotSupported(f"{trainer} cannot train this model exactly under sequence parallelism:\n- "
                           + "\n- ".join(problems), "set the adapters' dropout to 0.0 as each line above says")


def check_materialised(model: Any, trainer: str, name: str = "model") -> None:
    """Every parameter and buffer of `model` holds data: none on the meta device (a model built
    under `torch.device("meta")` or loaded with `device_map="meta"`), which would fail at the
    Trainer's `.to(device)` in one process and at the first forward under FSDP2, naming one
    tensor. Refused naming them all (the first 8 and the count beyond) and how to materialise."""
    from hf_longctx.model_walk import hf_model

    hf = hf_model(model)
    params = [n for n, p in hf.named_parameters() if p.is_meta]
    buffers = [n for n, b in hf.named_buffers() if b.is_meta]
    if not params and not buffers:
        return

    def listed(names: list[str], what: str) -> str:
        more = f", ... and {len(names) - 8} more" if len(names) > 8 else ""
        return f"{len(names)} {what} ({', '.join(names[:8])}{more})"

    held = " and ".join(listed(n, w) for n, w in ((params, "parameter(s)"), (buffers, "buffer(s)")) if n)
    raise NotSupported(
        f"{trainer}: the {name} {type(hf).__name__} has {held} on the meta device: they hold no data, so training "
        "would fail at the first move or forward",
        "materialise the weights before the trainer: load them with AutoModelForCausalLM.from_pretrained(path) without "
        "device_map='meta'; or, for a model built under torch.device('meta'), model.to_empty(device='cpu'), then "
        "model.init_weights() (it also re-creates the buffers no checkpoint holds, such as RoPE's inv_freq), then "
        "model.load_state_dict(state_dict) with the real weights. (One host copy of the weights per job, the other ranks "
        "on meta, is fsdp_plan(model, mesh).apply(model, broadcast_from_rank0=True) in your own loop.)",
    )


def check_mesh_world(mesh: Mesh) -> None:
    check_world(mesh.world.world_size)
