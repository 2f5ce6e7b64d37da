"""Where a trainer's mesh comes from: `mesh=`, or the `ParallelismConfig` of the training
arguments or of the launcher.

Where it sits: the first step of a trainer's construction that may create process groups, on
every rank alike. Without a config it returns `mesh=` as given. With one -- `TrainingArguments(
parallelism_config=...)`, else what `accelerate launch` exported from a YAML's `parallelism_config:`
(ACCELERATE_USE_PARALLELISM_CONFIG, PARALLELISM_CONFIG_*) -- it maps the config onto the mesh
(`integrations/parallelism_config.py`): a model patched already, or `mesh=`, must agree with it
(the SP degree; its Ulysses x ring split stands as the user's override), refused field by field
otherwise; with neither, the trainer builds the mesh by the rule and patches the model with it.
Guarantee: the `Accelerator` never acts on the config: the Trainer gets arguments without it
(`without_parallelism_config`) and builds its Accelerator with the launcher's flag hidden
(`launcher_config_hidden`), so no second mesh, context-parallel or DeepSpeed-SP path exists."""

from __future__ import annotations

import copy
import dataclasses
import os
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

from hf_longctx.distributed.mesh import init_sequence_parallel, process_group_world
from hf_longctx.distributed.mesh_protocol import Mesh
from hf_longctx.errors import NotSupported
from hf_longctx.flex.bank import GroupBank
from hf_longctx.integrations.model_patch import is_patched, patch_state
from hf_longctx.integrations.parallelism_config import (
    ENV_FLAG, ParallelismMap, launcher_parallelism_config, launcher_ranks_per_node, map_parallelism_config, model_heads,
    written,
)
from hf_longctx.model_walk import hf_model


def parallelism_config_of(args: Any) -> tuple[Any, str]:
    """(the config the run asks for, where it was written): the training arguments' field, else
    the launcher's variables; (None, "") without either."""
    pc = getattr(args, "parallelism_config", None)
    if pc is not None:
        return pc, f"{type(args).__name__}(parallelism_config=...)"
    pc = launcher_parallelism_config()
    return (pc, "the launcher's PARALLELISM_CONFIG_* variables (accelerate launch)") if pc is not None else (None, "")


def _agree(mapped: ParallelismMap, mesh: Mesh, pc: Any, what: str) -> None:
    """A mesh fixed by the user (patched model, `mesh=`) must have the SP degree the config asks for."""
    if isinstance(mesh, GroupBank):
        raise NotSupported(
            f"{mapped.written} asks for one SP degree, but {what} is a GroupBank (flexible SP groups)",
            "drop parallelism_config to train with the bank, or patch the model with "
            "hf_longctx.mesh_from_parallelism_config(pc, model.config)",
        )
    if mesh.sp != mapped.sp:
        field = "sp_size" if pc.sp_size > 1 else "cp_size"
        raise NotSupported(
            f"{field}={getattr(pc, field)} of {mapped.written} asks for an SP group of {mapped.sp} rank(s), but {what} "
            f"has ulysses {mesh.ulysses} x ring {mesh.ring} = {mesh.sp}",
            f"set {field}={mesh.sp}, or build that mesh with hf_longctx.mesh_from_parallelism_config(pc, model.config) "
            "and patch the model with it",
        )


def trainer_mesh(model: Any, args: Any, mesh: Mesh | None, *, trainer: str, max_tokens: int | None) -> tuple[Mesh, int | None]:
    """(the trainer's mesh, its micro-batch cap): `mesh` when no ParallelismConfig is set; else
    the config's mesh (see the module docstring), and `max_tokens` defaulted to its
    `sp_seq_length`. Says the mapping once (a warning on rank 0)."""
    pc, where = parallelism_config_of(args)
    if pc is None:
        if mesh is None:
            raise NotSupported(
                f"{trainer} got no mesh: neither mesh= nor a ParallelismConfig (TrainingArguments(parallelism_config=...) "
                "or an accelerate YAML's parallelism_config)",
                "pass mesh=hf_longctx.init_sequence_parallel(ulysses_degree=..., ring_degree=...) and patch the model "
                "with it, or TrainingArguments(parallelism_config=accelerate.ParallelismConfig(sp_size=...))",
            )
        return mesh, max_tokens
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        raise NotSupported(
            f"{written(pc)} came with Accelerate's FSDP turned on by the launch (ACCELERATE_USE_FSDP=true: "
            "distributed_type FSDP, or --use_fsdp, which accelerate launch requires with --use_parallelism_config): "
            "hf_longctx shards the model itself with FSDP2 over the whole world, and Accelerate's FSDP path in the "
            "Trainer is not verified on top of it",
            "launch with distributed_type: MULTI_GPU and the parallelism_config section in that YAML (accelerate "
            "launch exports it the same way; accelerate_configs/gpu_2node_sp.yaml), or pass "
            "TrainingArguments(parallelism_config=...) under a MULTI_GPU launch")
    if model is None or isinstance(model, str):
        raise ValueError("pass a model instance (a ParallelismConfig's mesh is built for the model's heads), not a "
                         "name or None")
    _, world = process_group_world(trainer)
    fixed, what = (mesh, "mesh=") if mesh is not None else (
        (patch_state(model).bank, "the mesh the model was patched with") if model is not None and is_patched(model)
        else (None, ""))
    mapped = map_parallelism_config(pc, world_size=world, heads=model_heads(hf_model(model).config),
                                    ranks_per_node=launcher_ranks_per_node(world))
    if fixed is not None:
        _agree(mapped, fixed, pc, what)
    if mapped.seq_length is not None and max_tokens is not None and max_tokens != mapped.seq_length:
        raise NotSupported(
            f"max_tokens={max_tokens} and sp_seq_length={mapped.seq_length} of {mapped.written} disagree: both set the "
            "tokens of one micro-batch", "pass one of them, or the same value")
    if fixed is None:
        from hf_longctx.patching import patch

        fixed = init_sequence_parallel(mapped.ulysses, mapped.ring)
        patch(model, fixed)
    if process_rank() == 0:
        said = dataclasses.replace(mapped, ulysses=fixed.ulysses, ring=fixed.ring).describe()
        if fixed.ulysses != mapped.ulysses:
            said += f"\n  - the Ulysses x ring split is that of {what} (the rule's: {mapped.ulysses} x {mapped.ring})"
        warnings.warn(f"{trainer}: {said}\n  (read from {where})", stacklevel=4)
    return fixed, max_tokens if max_tokens is not None else mapped.seq_length


def process_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def without_parallelism_config(mapped: Any, user: Any) -> Any:
    """The arguments the Trainer gets: `mapped` (a copy already, or the user's own `user` object,
    then copied here) with `parallelism_config=None`, so the Accelerator does not act on it."""
    if getattr(mapped, "parallelism_config", None) is None:
        return mapped
    out = copy.copy(mapped) if mapped is user else mapped
    out.parallelism_config = None
    return out


@contextmanager
def launcher_config_hidden() -> Iterator[None]:
    """While the Trainer builds its Accelerator: the launcher's ACCELERATE_USE_PARALLELISM_CONFIG
    removed (the Accelerator would build a `ParallelismConfig` from PARALLELISM_CONFIG_* and a
    device mesh of its own), restored after."""
    saved = os.environ.pop(ENV_FLAG, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[ENV_FLAG] = saved
