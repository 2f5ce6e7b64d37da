"""Rows per LM-head chunk: the one rule of the runtime, the planner and the step-time model.

Where it sits: the chunked loss (`integrations/memory.py` -> `ops/chunked_loss.py`) and the
log-prob head (`integrations/logprob_head.py` -> `ops/chunked_logprobs.py`) cut their rows with
`loss_chunk_rows`; the planner's memory (`capacity/budget_terms.loss_rows`) and step time
(`capacity/step_time.shape_of`) call it with the same arguments, and where a setting's GPU
memory binds `capacity/search.py` lowers its chunk -- never below `memory_rows` -- and hands the
rows to `patch(loss_chunk_rows=)`. Guarantees: "auto" chunks of at least COMPUTE_ROWS rows (the
head's GEMMs compute-bound), a count (`loss_chunks=N`) or rows (`loss_chunk_rows=R`) given by the
user taken as given, every answer between 1 and the rows of the call. FPDT §3.5 (chunked loss).
"""

from __future__ import annotations

import math
from typing import Any

# A chunk's weight-gradient GEMM reads its bf16 operands and reads and writes the head's fp32
# gradient sum: 2·V·r·Hd FLOPs over about 8·V·Hd + 2·V·r bytes. Above the GPU's FLOP/byte ridge
# (H100 SXM: 989 TFLOP/s over 3.35 TB/s, 295) it is compute-bound: Llama-3.1-8B's head at 2048
# rows 453 FLOP/B, at 256 rows 63 (the 2.1 GB sum moved per chunk dominates). Read-only constant.
COMPUTE_ROWS = 2048
# The memory floor's own floor: a toy model's V / Hd (500+ for a 64-wide one) would cut a
# sequence into few-row GEMMs. Read-only constant, not a flag.
MIN_ROWS = 256


def config_sizes(config: Any) -> tuple[int, int]:
    """(vocab, hidden) of a transformers config (a multimodal one's text config); raises
    ValueError naming what is missing."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab, hidden = getattr(text, "vocab_size", None), getattr(text, "hidden_size", None)
    if not vocab or not hidden:
        raise ValueError(f"config needs vocab_size and hidden_size, got vocab_size={vocab}, hidden_size={hidden}")
    return int(vocab), int(hidden)


def memory_rows(vocab: int, hidden: int, rows: int) -> int:
    """The smallest chunk the planner lowers to where memory binds: about 8·V/Hd chunks, so one
    fp32 [chunk, V] tensor is a quarter of the sequence's bf16 hidden states and the loss's
    transient (three such tensors and one in the compute dtype) stays under one hidden-size
    vector per token; at least MIN_ROWS, at most `rows`."""
    chunks = max(1, math.ceil(8 * vocab / hidden))
    return min(rows, max(math.ceil(rows / chunks), MIN_ROWS))


def loss_chunk_rows(vocab: int, hidden: int, rows: int, chunks: int | str | None = "auto",
                    chunk_rows: int | None = None) -> int:
    """Rows per LM-head chunk of a call over `rows` tokens (B·S of the local shard).

    `chunk_rows` (`patch(loss_chunk_rows=R)`, the user's or the plan's where memory binds): R.
    Else `chunks`: an int N (`patch(loss_chunks=N)`) cuts the rows into N chunks; None, one
    chunk; "auto" (the presets), the larger of COMPUTE_ROWS and `memory_rows` (the memory rule
    alone made 256-row chunks of Llama-3.1-8B at 32K tokens: a memory-bound head). At most
    `rows` in every case."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got rows={rows}")
    if chunk_rows is not None:
        return min(rows, chunk_rows)
    if chunks is None:
        return rows
    if chunks == "auto":
        return min(rows, max(COMPUTE_ROWS, memory_rows(vocab, hidden, rows)))
    return math.ceil(rows / min(chunks, rows))
