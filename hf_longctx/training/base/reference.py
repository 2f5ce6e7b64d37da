"""The frozen reference model of a post-training objective (DPO, GRPO's KL term), on the mesh:
TRL's default reference loaded again from the policy's path, or the user's, patched like the
policy.

Where it sits: construction of the trainers that score a reference; the reference then runs
on the same shard as the policy under no_grad. One setup for both: `reference_on_mesh` here,
then `SPTrainerBase._place_reference`. Only its moment differs, as TRL dictates: DPOTrainer
takes a `ref_model` argument (patched before `DPOTrainer.__init__`), GRPOTrainer loads its own
inside `__init__` (patched right after it).
"""

from __future__ import annotations

from typing import Any

from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.integrations.model_patch import is_patched, patch, patch_state


def default_reference(model: Any, mesh: SPMesh, trust_remote_code: bool) -> Any:
    """TRL's default reference (`ref_model=None`): the model loaded again from its path, in the
    policy's dtype, patched with the same mesh and memory knobs (no checkpointing: no backward)."""
    from trl.trainer.utils import create_model_from_path, get_config_model_id

    ref = create_model_from_path(get_config_model_id(model.config), dtype=model.dtype, trust_remote_code=trust_remote_code)
    return reference_on_mesh(ref, model, mesh)


def reference_on_mesh(ref: Any, model: Any, mesh: SPMesh) -> Any:
    """`ref` patched like the policy (same mesh, same kv_offload / mlp_chunks / mixers), frozen."""
    if is_patched(ref):
        state = patch_state(ref)
        if state.bank != mesh:
            raise ValueError("ref_model was patched with a different mesh than the trainer's `mesh`")
    else:
        policy = patch_state(model)
        options = policy.options
        ref = patch(ref, mesh, kv_offload=options.kv_offload, mlp_chunks=options.mlp_chunks, mixers=policy.mixers_option)
    return ref.eval().requires_grad_(False)
