"""The dry run's inputs: the probe lengths, the per-token stand-in attention and the loss check.

Where it sits: used by `dry_run.probe_model` before and during its runs. The probe length
is chosen distinct from every size in the model (so a dim of that size IS the sequence);
the stand-in makes attention per-token (token i attends only to itself), so any remaining
mixing is a module's own; the loss check measures that the model's loss is computed from
`shift_labels` (what `shard_batch` hands each rank), on run A plus one extra forward.
"""

from __future__ import annotations

import torch


def probe_lengths(hf) -> tuple[int, int, int]:
    """(len doc 0, len doc 1, shard start): the probe length S and the shard length S - a
    must differ from every size in the model, so a dim of that size IS the sequence."""
    sizes = {n for p in hf.parameters() for n in p.shape} | {n for p in hf.buffers() for n in p.shape}

    def ints(obj, depth=0):
        if depth > 3:
            return
        for v in (vars(obj).values() if hasattr(obj, "__dict__") else []):
            if isinstance(v, int) and not isinstance(v, bool):
                sizes.add(v)
            elif isinstance(v, (list, tuple)):
                sizes.update(x for x in v if isinstance(x, int))
            elif hasattr(v, "to_dict") and hasattr(v, "model_type"):
                ints(v, depth + 1)

    ints(hf.config)
    for s in range(11, 200):
        a = 3  # the shard starts mid-document 0, after the perturbed token 1
        if s not in sizes and (s - a) not in sizes:
            return s // 2, s - s // 2, a
    raise ValueError("no probe length distinct from the model's sizes in 11..199")


def per_token(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling) -> tuple:
    """The stand-in attention: token i attends only to itself (out = v * sigmoid(q.k))."""
    h, h_kv = query.shape[1], key.shape[1]
    k_e = key.repeat_interleave(h // h_kv, dim=1) if h != h_kv else key  # [B, H, S, D]
    v_e = value.repeat_interleave(h // value.shape[1], dim=1) if h != value.shape[1] else value  # [B, H, S, Dv]
    d = min(query.shape[-1], k_e.shape[-1])
    gate = torch.sigmoid((query[..., :d] * k_e[..., :d]).sum(-1, keepdim=True) * (scaling or d**-0.5))  # [B, H, S, 1]
    return (v_e * gate).transpose(1, 2).contiguous(), None  # [B, S, H, Dv]


def shift_label_pair(hf, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two `shift_labels` for the probe ids: the next-token targets, and the same with the
    first half dropped. A model whose loss is computed from `shift_labels` (what shard_batch
    hands each rank: targets shifted on the whole packed sequence, with the global token
    count) gives two different losses for them; the dry run's run A takes the first, one
    extra forward the second."""
    text = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    n_out = getattr(text, "vocab_size", None) or hf.get_input_embeddings().num_embeddings  # the LM head's classes
    targets = torch.roll(ids, -1, dims=1) % n_out  # [1, S]: Mllama's embedding has more rows than its head
    targets[:, -1] = -100
    other = targets.clone()
    other[:, : ids.shape[1] // 2] = -100  # [1, S]: half the targets dropped
    return targets, other


def no_shift_labels(hf, error: TypeError) -> str:
    return f"{type(hf).__name__}.forward does not take shift_labels ({error})"


def loss_ignores_shift_labels(hf, loss: torch.Tensor | None, other: torch.Tensor | None) -> str | None:
    """None if the two losses of `shift_label_pair` differ, else why the model is refused."""
    if loss is None or other is None or torch.equal(loss, other):
        return (
            f"{type(hf).__name__} computes its loss without shift_labels (not through transformers' ForCausalLMLoss), "
            "so the targets shard_batch shifted on the whole packed sequence and the global token count would be "
            "ignored; e.g. WhisperForCausalLM takes labels that are not shifted and averages over each rank's shard"
        )
    return None
