"""What cannot run exactly under sequence parallelism, refused at `patch()` time.

Where it sits: the first thing `integrations/transformers.py`'s `patch()` calls, before it
changes anything. DESIGN invariant 7 (outputs and gradients equal the single-device
ones) rules out: attention dropout (the shards would draw different masks than one
device), RoPE variants whose frequencies depend on the sequence length each rank sees
(dynamic NTK, longrope), models whose attention bypasses transformers' AttentionInterface
(their attention cannot be replaced), non-causal attention modules (those the dry run of
`probe.py` sees called; by name when it is switched off), and loss functions
that would shift the already shifted labels again. Each refusal says what to change.
"""

from __future__ import annotations

import inspect

import torch

from hf_longctx.config import PatchOptions
from hf_longctx.data.sharding import SP_METADATA_KEY
from hf_longctx.distributed.mesh import SPMesh

SUPPORTED = "models whose attention uses AttentionInterface, e.g. (tested) Llama, Mistral, Qwen2, Qwen3, Phi3, Gemma2, GPT-2, GPT-NeoX, GPTBigCode"
_DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout")
_INEXACT_ROPE = {
    "dynamic": "rescales RoPE frequencies from max(position_ids) + 1, which every SP rank takes from its own shard",
    "longrope": "switches between short and long factors on max(position_ids) + 1, which every SP rank takes from its own shard",
}


def configs(hf) -> list:
    """Every config whose `_attn_implementation` a switch may touch: the model's, its
    sub-configs at any depth, and those of nested PreTrainedModels (deduplicated by id)."""
    from transformers import PreTrainedModel

    out, seen, todo = [], set(), [hf.config] + [m.config for m in hf.modules() if isinstance(m, PreTrainedModel)]
    while todo:
        cfg = todo.pop()
        if cfg is None or id(cfg) in seen:
            continue
        seen.add(id(cfg))
        out.append(cfg)
        todo.extend(getattr(cfg, key, None) for key in getattr(cfg, "sub_configs", {}) or {})
    return out


def attention_modules(hf) -> list:
    return [m for m in hf.modules() if type(m).__name__.endswith("Attention")]


def _rope_types(cfg) -> set[str]:
    types = set()
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(cfg, attr, None)
        if not isinstance(params, dict):
            continue
        nested = [params] if "rope_type" in params or "type" in params else [p for p in params.values() if isinstance(p, dict)]
        for p in nested:
            types.add(str(p.get("rope_type", p.get("type", "default"))))
    return types


def refuse_inexact(
    hf, mesh: SPMesh, options: PatchOptions, *, structural: bool = True, used_kwargs=frozenset(), ignored_kwargs=frozenset(),
    handled: frozenset = frozenset(),
):
    """Raise before anything is changed if the model cannot run EXACTLY under SP.

    `structural=False` (patch's unsafe_skip_exactness_check) skips the dry run of
    `probe.py`; the config rules below always apply. `handled`: module classes that run under
    a sequence-parallel wrapper (`integrations/mixers.py`); the dry run trusts them. Returns
    the probe's report (or None)."""
    from transformers import PreTrainedModel

    cls = type(hf).__name__
    bypass = sorted({type(m).__name__ for m in hf.modules() if isinstance(m, PreTrainedModel) and not m._can_set_attn_implementation()})
    if bypass:
        raise NotImplementedError(
            f"{', '.join(bypass)} {'do' if len(bypass) > 1 else 'does'} not call attention through transformers' AttentionInterface, so its attention "
            f"cannot be replaced by sequence-parallel attention (transformers would silently keep "
            f"'{hf.config._attn_implementation}'). hf_longctx supports {SUPPORTED}."
        )
    layers = attention_modules(hf)  # by name: only to check their dropout / causality fields below
    problems = []
    for cfg in configs(hf):
        for name in _DROPOUT_FIELDS:
            p = getattr(cfg, name, None)
            if isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0:
                problems.append(
                    f"{type(cfg).__name__}.{name} = {p}: attention dropout cannot be reproduced exactly under sequence "
                    f"parallelism; load the model with {name}=0.0, e.g. "
                    f"AutoModelForCausalLM.from_pretrained(path, {name}=0.0) (setting config.{name} after loading "
                    "does not change the already-built attention modules)"
                )
        for rope in sorted(_rope_types(cfg) & _INEXACT_ROPE.keys()):
            problems.append(
                f"{type(cfg).__name__} uses rope_type '{rope}', which {_INEXACT_ROPE[rope]}, so shards would get "
                "different frequencies than one device; use a static RoPE ('default', 'linear', 'yarn', 'llama3') "
                "via rope_parameters when loading"
            )
        if getattr(cfg, "output_attentions", False):
            problems.append(f"{type(cfg).__name__}.output_attentions = True: sequence-parallel attention returns no weights; set it to False")
    if not any("dropout" in p for p in problems):
        for m in layers:
            p = getattr(m, "attention_dropout", None)
            drop = getattr(m, "attn_dropout", None)
            p = drop.p if isinstance(drop, torch.nn.Dropout) else p
            if isinstance(p, (int, float)) and p > 0:
                problems.append(
                    f"{type(m).__name__} was built with attention dropout {p} although the config now says 0: "
                    "reload the model with the attention-dropout field set to 0.0 in from_pretrained(...)"
                )
                break
    if not structural:  # without the dry run, by name: every non-causal attention module refuses (the dry run
        # refuses only those a forward calls, so a multimodal model's unused vision tower does not)
        non_causal = sorted({type(m).__name__ for m in layers if getattr(m, "is_causal", True) is False})
        if non_causal:
            from hf_longctx.integrations.refusals import non_causal_message

            problems.append(non_causal_message(non_causal))
    try:
        params = inspect.signature(hf.loss_function).parameters
    except (TypeError, ValueError, AttributeError):
        params = {}
    if "shift_labels" not in params:
        problems.append(
            f"{cls}.loss_function does not take shift_labels, so it would shift the already shifted labels of "
            "shard_batch again; use transformers' ForCausalLMLoss (config.loss_type = None)"
        )
    try:
        options.check_mesh(mesh.fpdt_chunks)
    except ValueError as e:
        problems.append(str(e))
    for cfg in configs(hf):
        if getattr(cfg, "output_router_logits", False):
            problems.append(
                f"{type(cfg).__name__}.output_router_logits = True: the MoE load-balancing loss would be computed from each "
                "rank's shard (its per-expert token fractions and router probabilities are means over the shard, and their "
                "product is not additive over ranks), so the summed loss would differ from the single-device one; load the "
                "model with output_router_logits=False (TRL: model_init_kwargs={'output_router_logits': False})"
            )
            break
    report = None
    if structural and not problems:
        from hf_longctx.integrations.probe import probe_model
        from hf_longctx.integrations.refusals import describe

        report = probe_model(hf, SP_METADATA_KEY, frozenset(used_kwargs), frozenset(ignored_kwargs), handled=handled)
        problems.extend(describe(report))
    if problems:
        raise ValueError(f"cannot patch {cls} for exact sequence parallelism:\n- " + "\n- ".join(problems))
    return report
