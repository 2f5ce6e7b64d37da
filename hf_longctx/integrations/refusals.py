"""The words of a structural refusal: turn `probe.ProbeReport` into messages that name the
module class, the layers and what would make the model work.

Where it sits: between `probe.py` (which decides, by measurement only) and
`exactness.refuse_inexact` (which raises). The keyword hints below only ENRICH a refusal the
probe already made; no name ever makes a model pass.
"""

from __future__ import annotations

from hf_longctx.integrations.probe.report import ProbeReport

# (substring of the lowercased class name, what it is and why it cannot be exact on shards)
_HINTS = (
    ("indexer", "a sparse-attention indexer: it picks a global top-k of keys per query, which cannot be computed from one rank's shard"),
    ("mamba", "a state-space (Mamba) mixer: its scan carries a state from every earlier token of the sequence"),
    ("ssm", "a state-space mixer: its scan carries a state from every earlier token of the sequence"),
    ("gateddelta", "gated-delta / linear attention: a recurrence over the whole sequence, not softmax attention"),
    ("linearattention", "linear attention: a recurrence over the whole sequence, not softmax attention"),
    ("lightning", "linear (lightning) attention: a recurrence over the whole sequence"),
    ("conv", "a causal convolution over the sequence: its first outputs on a shard need the last tokens of the previous shard"),
    ("recurrent", "a recurrent block: its state runs over the whole sequence"),
    ("rglru", "a recurrent (RG-LRU) block: its state runs over the whole sequence"),
    ("lstm", "a recurrent block: its state runs over the whole sequence"),
    ("rnn", "a recurrent block: its state runs over the whole sequence"),
)
_KWARG_HINTS = {
    "position_bias": "an additive relative-position bias on the attention logits",
    "attention_bias": "an additive bias on the attention logits",
    "alibi": "an ALiBi bias on the attention logits",
}
_MASK_HINTS = {
    "chunked_overlay": "chunked local attention (e.g. Llama 4's attention_chunk_size): tokens see only their own chunk",
    "blockwise_overlay": "bidirectional blocks (e.g. image tokens)",
    "bidirectional": "bidirectional attention",
}


def _hint(cls_name: str) -> str:
    low = cls_name.lower().replace("_", "")
    for key, text in _HINTS:
        if key in low:
            return f" -- this looks like {text}"
    return ""


def _layers(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def describe(report: ProbeReport) -> list[str]:
    out = list(report.problems)
    for cls, names in report.leaks.items():
        out.append(
            f"{cls} ({_layers(names)}) mixes information across tokens outside the attention function{_hint(cls)}; on a "
            "shard it would see only this rank's tokens, so the result would silently differ from one device. It can run "
            "exactly only behind a sequence-parallel wrapper (hf_longctx.integrations.mixers.registry: sp_handled_classes() lists "
            "the mixers that have one) or without SP"
        )
    for cls, names in report.shape_deps.items():
        if cls in report.leaks:
            continue
        out.append(
            f"{cls} ({_layers(names)}) computes something from the local shard's length or index (its output for the same "
            "tokens and position_ids changes when they are fed as a shard that starts mid-document), e.g. a term built "
            "from arange(S) or cache_position; under SP every rank would use its local offsets"
        )
    for kw, classes in sorted(report.unknown_kwargs.items()):
        what = _KWARG_HINTS.get(kw, "an input the sequence-parallel attention does not apply")
        out.append(
            f"{', '.join(sorted(classes))} passes '{kw}' to the attention function: {what}; ignoring it would silently "
            "change the model. Supported attention inputs: q, k, v, scaling, sliding_window, softcap, s_aux (sinks)"
        )
    if report.non_causal:
        out.append(non_causal_message(report.non_causal))
    if report.tensor_masks:
        out.append(
            f"{', '.join(sorted(report.tensor_masks))} passes a materialised attention mask to the attention function, "
            "built outside transformers' mask interface at the local shard length; its pattern cannot be honoured under SP"
        )
    if report.no_metadata:
        out.append(
            f"the sequence-parallel metadata keyword never reaches {', '.join(sorted(report.no_metadata))}: the decoder "
            "layer calling it does not forward its **kwargs, so the attention could not know the global document layout"
        )
    for part in sorted(report.mask_parts):
        hint = next((v for k, v in _MASK_HINTS.items() if k in part), None)
        out.append(
            f"the model's attention mask contains '{part}'{f' ({hint})' if hint else ''}: sequence-parallel attention "
            "applies only causal document masks with a sliding window, so this pattern would be dropped"
        )
    from hf_longctx.integrations.attention import mask_implied_window

    missing = report.windows_mask - report.windows_attention
    implied = mask_implied_window(report.mask_windows)  # one window on every mask: sp_attention applies it itself
    if missing and (implied is None or report.windows_attention - {implied}):
        out.append(
            f"the model's mask uses sliding window(s) {sorted(missing)} that never reach the attention function "
            f"(it receives {sorted(report.windows_attention) or 'none'}), so the window would be dropped"
        )
    if not out and report.attention_calls == 0:
        out.append("no attention call went through transformers' AttentionInterface in a dry run; nothing could be made sequence-parallel")
    return out


def non_causal_message(classes) -> str:
    """The refusal of attention modules with is_causal=False (the dry run's and the by-name check's)."""
    return f"{', '.join(sorted(classes))} is not causal (is_causal=False); hf_longctx supports causal self-attention only"
