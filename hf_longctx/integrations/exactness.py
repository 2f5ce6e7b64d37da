"""What cannot run exactly under sequence parallelism, refused at `patch()` time.

Where it sits: the first thing `patch()` calls, before it changes anything. Invariant 7
(outputs and gradients equal the single-device ones) rules out: attention dropout, dropout in
PEFT adapters (`adapter_dropout.py`),
RoPE variants scaled by each rank's local length (dynamic NTK, longrope), attention that
bypasses transformers' AttentionInterface, non-causal attention modules (those the dry run
sees called; by name when it is off), and losses that would shift the already shifted
labels again. Encoders, encoder-decoders and parameters shared between modules are refused
first, by cause (`architecture.py`). Each refusal says what to change."""

from __future__ import annotations

import inspect

import torch

from hf_longctx.config import PatchOptions
from hf_longctx.data.sharding import SP_METADATA_KEY
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.errors import NO_SP, NotSupported
from hf_longctx.integrations.adapter_dropout import adapter_dropout_problems
from hf_longctx.model_walk import configs

SUPPORTED = "models whose attention uses AttentionInterface, e.g. (tested) Llama, Mistral, Qwen2, Qwen3, Phi3, Gemma2, GPT-2, GPT-NeoX, GPTBigCode"
_DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout")
_INEXACT_ROPE = {
    "dynamic": "rescales RoPE frequencies from max(position_ids) + 1, which every SP rank takes from its own shard",
    "longrope": "switches between short and long factors on max(position_ids) + 1, which every SP rank takes from its own shard",
}


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


def _config_heads(hf) -> dict:
    """(query heads, KV heads) from the configs, where the dry run did not run (unsafe mode)."""
    out = {}
    for cfg in configs(hf):
        h = getattr(cfg, "num_attention_heads", None)
        if isinstance(h, int) and h > 0:
            kv = getattr(cfg, "num_key_value_heads", None)
            out.setdefault((h, kv if isinstance(kv, int) and kv > 0 else h), set()).add(type(cfg).__name__)
    return out


def head_problems(heads: dict, ulysses_degrees) -> list[str]:
    """Each (query heads, KV heads) the attention is called with, against every Ulysses degree
    it will run at (a GroupBank has several): what `ops/ulysses.kv_replication` would raise at
    the first forward, said at patch() instead."""
    from hf_longctx.ops.ulysses import kv_replication

    problems = []
    for (h, kv), where in sorted(heads.items()):
        for u in sorted(set(ulysses_degrees)):
            try:
                kv_replication(h, kv, u)
            except ValueError as e:
                usable = [d for d in range(1, h + 1) if h % d == 0 and _replicable(h, kv, d)]
                problems.append(
                    f"{', '.join(sorted(where))}: {e}; this attention splits over Ulysses degrees "
                    f"{usable} only -- use one of them and put the rest of the SP degree on the ring "
                    "(init_sequence_parallel(ulysses_degree=..., ring_degree=...))"
                )
    return problems


def _replicable(h: int, kv: int, u: int) -> bool:
    from hf_longctx.ops.ulysses import kv_replication

    try:
        kv_replication(h, kv, u)
        return True
    except ValueError:
        return False


def dtype_problems(hf) -> list[str]:
    """fp16 weights: the attention refuses fp16 at its first forward (compute_dtype); say it here."""
    half = sorted({n.split(".")[-1] for n, p in hf.named_parameters() if p.dtype == torch.float16})
    if not half:
        return []
    return [
        f"the model has float16 weights ({', '.join(half[:4])}{' ...' if len(half) > 4 else ''}): hf_longctx's attention "
        "refuses fp16 (its range needs loss scaling; the ring/FPDT merges are verified for fp32 and bf16); load it with "
        "from_pretrained(..., dtype=torch.bfloat16) (or torch.float32), or model.to(torch.bfloat16)"
    ]


def refuse_inexact(
    hf, mesh: SPMesh, options: PatchOptions, *, structural: bool = True, used_kwargs=frozenset(), ignored_kwargs=frozenset(),
    handled: frozenset = frozenset(), ulysses_degrees: tuple = (), keep_configs: frozenset = frozenset(),
):
    """Raise before anything is changed if the model cannot run EXACTLY under SP.

    `structural=False` (patch's unsafe_skip_exactness_check) skips the dry run of
    `probe/dry_run.py`; the config rules below always apply. `ulysses_degrees`: every Ulysses degree
    the attention will run at (a GroupBank's groups; default the mesh's), checked against the
    head counts the dry run saw (the configs' without it), as the fp16 weights are. `handled`: module classes that run under
    a sequence-parallel wrapper (`integrations/mixers/`); the dry run trusts them. Returns
    the probe's report (or None). `keep_configs`: ids of the configs `patch()` leaves alone (a
    vision tower's: it keeps its own attention, which need not go through the interface)."""
    cls = type(hf).__name__
    _refuse_architecture(hf, cls)  # decisive: no setting below could make these models train
    _refuse_bypass(hf, keep_configs)
    layers = attention_modules(hf)  # by name: only to check their dropout / causality fields below
    problems = _config_problems(hf)
    if not any("dropout" in p for p in problems):
        problems += _module_dropout_problems(layers)
    problems += adapter_dropout_problems(hf)  # a PEFT adapter's lora_dropout & co.
    if not structural:  # without the dry run, by name: every non-causal attention module refuses (the dry run
        # refuses only those a forward calls, so a multimodal model's unused vision tower does not)
        problems += _non_causal_by_name(hf, layers, keep_configs)
    problems += _loss_function_problems(hf, cls)
    try:
        options.check_mesh(mesh.fpdt_chunks)
    except ValueError as e:
        problems.append(str(e))
    problems += _router_logits_problems(hf)
    problems += dtype_problems(hf)
    report = None
    if structural and not problems:
        from hf_longctx.integrations.probe.dry_run import probe_model
        from hf_longctx.integrations.refusals import describe

        report = probe_model(hf, SP_METADATA_KEY, frozenset(used_kwargs), frozenset(ignored_kwargs), handled=handled)
        problems.extend(describe(report))
    degrees = tuple(ulysses_degrees) or (mesh.ulysses,)
    if not problems and any(u > 1 for u in degrees):
        problems += head_problems(report.heads if report is not None else _config_heads(hf), degrees)
    if problems:
        raise NotSupported(
            f"cannot patch {cls} for exact sequence parallelism:\n- " + "\n- ".join(problems),
            "where a line above names a setting, reload or re-patch with it changed; otherwise " + NO_SP,
        )
    return report


def _refuse_architecture(hf, cls: str) -> None:
    """Encoders, encoder-decoders and shared parameters (`architecture.py`): refused by cause."""
    from hf_longctx.integrations.architecture import architecture_problems

    architecture = architecture_problems(hf)
    if architecture:
        raise NotSupported(
            f"cannot patch {cls} for sequence-parallel training:\n- " + "\n- ".join(architecture),
            "train a decoder-only causal LM (e.g. Llama, Qwen3, ModernBERT-decoder for a BERT-sized one); "
            "hf_longctx.verify(model, mesh) reports which layers of an untried model are exact",
        )


def _refuse_bypass(hf, keep_configs: frozenset) -> None:
    """Models (but a kept vision tower) whose attention does not go through AttentionInterface."""
    from transformers import PreTrainedModel

    bypass = sorted({
        type(m).__name__ for m in hf.modules()
        if isinstance(m, PreTrainedModel) and id(m.config) not in keep_configs and not m._can_set_attn_implementation()
    })
    if bypass:
        raise NotSupported(
            f"{', '.join(bypass)} {'do' if len(bypass) > 1 else 'does'} not call attention through transformers' AttentionInterface, so its attention "
            f"cannot be replaced by sequence-parallel attention (transformers would silently keep "
            f"'{hf.config._attn_implementation}'). hf_longctx supports {SUPPORTED}.",
            NO_SP,
        )


def _config_problems(hf) -> list[str]:
    """Per config, in order: attention dropout fields, a RoPE scaled by the local length, output_attentions."""
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
    return problems


def _module_dropout_problems(layers: list) -> list[str]:
    """The first attention module built with dropout although its config now says 0 (at most one line)."""
    for m in layers:
        p = getattr(m, "attention_dropout", None)
        drop = getattr(m, "attn_dropout", None)
        p = drop.p if isinstance(drop, torch.nn.Dropout) else p
        if isinstance(p, (int, float)) and p > 0:
            return [
                f"{type(m).__name__} was built with attention dropout {p} although the config now says 0: "
                "reload the model with the attention-dropout field set to 0.0 in from_pretrained(...)"
            ]
    return []


def _non_causal_by_name(hf, layers: list, keep_configs: frozenset) -> list[str]:
    """Without the dry run: every non-causal attention module outside a kept vision tower."""
    from transformers import PreTrainedModel

    tower = {id(m) for sub in hf.modules() if isinstance(sub, PreTrainedModel) and id(sub.config) in keep_configs for m in sub.modules()}
    non_causal = sorted({type(m).__name__ for m in layers if getattr(m, "is_causal", True) is False and id(m) not in tower})
    if not non_causal:
        return []
    from hf_longctx.integrations.refusals import non_causal_message

    return [non_causal_message(non_causal)]


def _loss_function_problems(hf, cls: str) -> list[str]:
    """A loss function that would shift `shard_batch`'s already shifted labels again."""
    try:
        params = inspect.signature(hf.loss_function).parameters
    except (TypeError, ValueError, AttributeError):
        params = {}
    if "shift_labels" in params:
        return []
    return [
        f"{cls}.loss_function does not take shift_labels, so it would shift the already shifted labels of "
        "shard_batch again; use transformers' ForCausalLMLoss (config.loss_type = None)"
    ]


def _router_logits_problems(hf) -> list[str]:
    """The first config that asks for the MoE load-balancing loss (at most one line)."""
    for cfg in configs(hf):
        if getattr(cfg, "output_router_logits", False):
            return [
                f"{type(cfg).__name__}.output_router_logits = True: the MoE load-balancing loss would be computed from each "
                "rank's shard (its per-expert token fractions and router probabilities are means over the shard, and their "
                "product is not additive over ranks), so the summed loss would differ from the single-device one; load the "
                "model with output_router_logits=False (TRL: model_init_kwargs={'output_router_logits': False})"
            ]
    return []
