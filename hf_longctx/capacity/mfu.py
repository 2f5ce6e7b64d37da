"""The numerator of MFU under three conventions, each with its source, so that a figure can be
set beside a published one counted another way.

Where it sits: `capacity/step_time.step_time` sets `Breakdown.model_flops` from
`strict_flops` (this project's MFU: `hf-longctx plan`, `benchmarks/gpu_throughput.py`,
`benchmarks/gpu_model.py`); those print `by_convention` beside it. MFU = credited FLOPs /
(seconds x the card's dense bf16 peak) in all three; they credit different FLOPs (`SOURCES`).
N = the decoder layers' parameters plus the LM head's (the embedding lookup not counted; a
tied head once) in the first two. Limits: a mixture of experts counts every expert's
parameters (`ModelDims.layer_params`), not the active ones.
"""

from __future__ import annotations

from hf_longctx.data.model_dims import ModelDims

STRICT, TORCHTITAN, MEGATRON_DEEPSPEED = "strict", "torchtitan", "Megatron-DeepSpeed"

SOURCES = {
    STRICT: ("this project's (capacity/mfu.py): 6·N·T + 6·L·H·D·l² per document of l tokens, the causal half of "
             "attention's square; recomputation not counted"),
    TORCHTITAN: ("torchtitan's (pytorch/torchtitan: torchtitan/models/utils.py, quadratic_attention_flops_per_token, "
                 "formerly get_num_flop_per_token's 6·N + 12·l·h·q·t): 6·N + 12·L·H·D·s per token, s the row's "
                 "length, the whole square (no causal halving); recomputation not counted"),
    MEGATRON_DEEPSPEED: ("Megatron-DeepSpeed's (microsoft/Megatron-DeepSpeed: megatron/utils.py, "
                         "throughput_calculator; Narayanan et al. 2021, eq. 3): 24·f·L·h²·(1 + s/(6h) + V/(16·L·h)) "
                         "per token, f = 4 with activation checkpointing (the recompute counted), else 3; the whole "
                         "square; GPT widths (4h MLP, as many K/V heads as query heads) whatever the model's"),
}


def dense_params(dims: ModelDims) -> float:
    """N: the parameters every token multiplies, forward (decoder layers and LM head)."""
    return float(dims.layers * dims.layer_params + dims.vocab * dims.hidden)


def strict_flops(dims: ModelDims, tokens: int, seq_len: int | None = None) -> float:
    """6 N T + 6 L H D (causal pairs x 2), documents of `seq_len` (default: one of `tokens`)."""
    seq_len = tokens if seq_len is None else seq_len
    docs, rest = divmod(tokens, seq_len)
    pairs = docs * seq_len * seq_len / 2 + rest * rest / 2
    return 6.0 * dense_params(dims) * tokens + 12.0 * dims.layers * dims.heads * dims.head_dim * pairs


def torchtitan_flops(dims: ModelDims, tokens: int) -> float:
    """(6 N + 12 L H D s) T for a row of s = `tokens`: torchtitan counts the training sequence
    length, not the documents packed in it."""
    return (6.0 * dense_params(dims) + 12.0 * dims.layers * dims.heads * dims.head_dim * tokens) * tokens


def megatron_deepspeed_flops(dims: ModelDims, tokens: int, checkpointed: bool) -> float:
    """throughput_calculator's FLOPs for one sequence of s = `tokens`: hidden size, layers and
    vocabulary only (its padded vocabulary is the model's here)."""
    h, layers, f = dims.hidden, dims.layers, 4 if checkpointed else 3
    return 24.0 * f * tokens * layers * h * h * (1.0 + tokens / (6.0 * h) + dims.vocab / (16.0 * layers * h))


def by_convention(dims: ModelDims, tokens: int, *, seq_len: int | None = None, checkpointed: bool = False) -> dict:
    """{convention: FLOPs credited for a row of `tokens` (documents of `seq_len`)}; `checkpointed`:
    the layers are recomputed in the backward (memory "high" / "max"), which only
    Megatron-DeepSpeed's count credits."""
    return {STRICT: strict_flops(dims, tokens, seq_len), TORCHTITAN: torchtitan_flops(dims, tokens),
            MEGATRON_DEEPSPEED: megatron_deepspeed_flops(dims, tokens, checkpointed)}


def mfu_line(dims: ModelDims, tokens: int, seconds: float, peak: float, *, seq_len: int | None = None,
             checkpointed: bool = False) -> str:
    """"MFU 27.3 % (strict) = 40.1 % by torchtitan's count = 52.2 % by Megatron-DeepSpeed's" for a
    row of `tokens` in `seconds` on a card of `peak` FLOP/s."""
    f = by_convention(dims, tokens, seq_len=seq_len, checkpointed=checkpointed)
    pct = {k: 100 * v / (seconds * peak) for k, v in f.items()}
    return (f"MFU {pct[STRICT]:.1f} % (strict) = {pct[TORCHTITAN]:.1f} % by torchtitan's count = "
            f"{pct[MEGATRON_DEEPSPEED]:.1f} % by Megatron-DeepSpeed's")
