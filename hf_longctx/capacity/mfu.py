"""The numerator of MFU: the FLOPs a training step is credited with.

Where it sits: `capacity/step_time.step_time` sets `Breakdown.model_flops` from
`strict_flops`, which `hf-longctx plan` and `benchmarks/gpu_model.py` divide by the modelled
seconds and the card's dense bf16 peak. Guarantees: one formula for the planner's and the
benchmarks' MFU; an MFU is an output of the step-time model, never an input.
"""

from __future__ import annotations

from hf_longctx.data.model_dims import ModelDims


def strict_flops(dims: ModelDims, tokens: int, seq_len: int | None = None) -> float:
    """6 (N_layers + N_head) T + 6 L H D (causal pairs x 2): the MFU numerator of
    benchmarks/gpu_throughput.py (embedding lookup not counted)."""
    seq_len = tokens if seq_len is None else seq_len
    docs, rest = divmod(tokens, seq_len)
    pairs = docs * seq_len * seq_len / 2 + rest * rest / 2
    head = dims.vocab * dims.hidden
    return 6.0 * (dims.layers * dims.layer_params + head) * tokens + 12.0 * dims.layers * dims.heads * dims.head_dim * pairs
