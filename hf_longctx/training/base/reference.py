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
from hf_longctx.integrations.model_patch import is_patched, patch_state, patch_with


def default_reference(model: Any, mesh: SPMesh, trust_remote_code: bool) -> Any:
    """TRL's default reference (`ref_model=None`): the model loaded again from its path, in the
    policy's dtype, patched with the same mesh and memory knobs (`reference_on_mesh`)."""
    from trl.trainer.utils import create_model_from_path, get_config_model_id

    ref = create_model_from_path(get_config_model_id(model.config), dtype=model.dtype, trust_remote_code=trust_remote_code)
    return reference_on_mesh(ref, model, mesh)


_SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id")


def _vocabulary(config: Any, model: Any = None) -> dict[str, Any]:
    """What must agree between a reference and the policy: the vocabulary size (the config's,
    and the embedding's / LM head's rows of an instance) and the special token ids."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    out = {"vocab_size": getattr(text, "vocab_size", None)}
    out.update({k: getattr(text, k, None) for k in _SPECIAL})
    if model is not None:
        for name, module in (("embedding rows", model.get_input_embeddings()), ("LM head rows", model.get_output_embeddings())):
            weight = getattr(module, "weight", None)
            out[name] = None if weight is None else int(weight.shape[0])
    return out


def check_reference(ref_config: Any, model: Any, ref: Any = None) -> None:
    """Raise ValueError, before any collective, when the reference (its config, and the instance
    `ref` when loaded) has another vocabulary or other special token ids than the policy `model`:
    the reference scores the policy's token ids, so both must read them with one tokenizer."""
    from hf_longctx.model_walk import hf_model

    policy = hf_model(model)
    mine, theirs = _vocabulary(policy.config, policy), _vocabulary(ref_config, hf_model(ref) if ref is not None else None)
    differ = {k: (mine[k], v) for k, v in theirs.items() if v is not None and mine.get(k) is not None and v != mine[k]}
    if differ:
        shown = ", ".join(f"{k} {b} (policy {a})" for k, (a, b) in differ.items())
        raise ValueError(f"the reference model's vocabulary differs from the policy's: {shown}; it would score the "
                         "policy's token ids with another tokenizer. Do instead: pass a reference that shares the "
                         "policy's tokenizer (e.g. the policy's own base checkpoint), or ref_model=None for TRL's "
                         "default (the policy loaded again from its path)")


def reference_on_mesh(ref: Any, model: Any, mesh: SPMesh) -> Any:
    """`ref` patched like the policy (same mesh, the policy's `PatchOptions` whole, its mixers), frozen;
    refused first when its vocabulary differs from the policy's (`check_reference`)."""
    check_reference(ref.config, model, ref)
    if is_patched(ref):
        state = patch_state(ref)
        if state.bank != mesh:
            raise ValueError("ref_model was patched with a different mesh than the trainer's `mesh`")
    else:
        policy = patch_state(model)
        options = policy.options
        # The policy's memory options: under memory="max" (checkpoint=True with chunked MLPs) its
        # no-grad forward runs the layers in row chunks too (`layer_split.call_no_grad`), so the
        # reference holds no more per token than the policy; its LM head is chunked by token_logprobs.
        ref = patch_with(ref, mesh, options, mixers=policy.mixers_option)  # every option, whole
    return ref.eval().requires_grad_(False)


def check_reference_path(model: Any, config: Any) -> None:
    """The reference a TRL rollout trainer will load (the policy's `config._name_or_path`)
    against the policy's vocabulary and special tokens (`check_reference`), before any
    collective; nothing to check when the policy names no path."""
    from transformers import AutoConfig
    from trl.trainer.utils import get_config_model_id

    path = get_config_model_id(model.config) if hasattr(model, "config") else ""
    if path:
        trust = bool(getattr(config, "trust_remote_code", False))
        check_reference(AutoConfig.from_pretrained(path, trust_remote_code=trust), model)
