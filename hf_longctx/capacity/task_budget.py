"""What a post-training objective adds to the per-token budget of a step: DPO, GRPO, RLOO against SFT.

Where it sits: `capacity/budget.step_budget(..., task=)` applies `with_task` to the SFT budget
of the same setting. Each term is a tensor of the census (`benchmarks/memory_budget.py --tasks`,
`benchmarks/post_training_steps.py`), written from the model's sizes. What changes: the LM head
runs `ops/chunked_logprobs` (always chunked, even where SFT's loss is not) in two phases, its
forward (the log-softmax of one chunk) and its backward (the chunk's logits recomputed, their
gradient, the head's weight gradient); the per-token objective inputs (fp64 rows of GRPO and
RLOO, the reference's fp32 log-probs of DPO) are held for the step; the frozen reference's
forward is a phase of its own (absent for "dpo-precomputed"), before the policy's (nothing of the policy is alive yet; its
layers row-chunked without gradients under memory="max", `layer_split.call_no_grad`).
Pairs and groups change no per-token term: a pair or a group is planned into one micro-batch of
`tokens` (`data/pairs.py`, `grpo/microbatches.py`), so `tokens` counts all its documents."""

from __future__ import annotations

from dataclasses import replace

from hf_longctx.capacity.budget_terms import Budget, Phase, Sizes, loss_rows, loss_terms

TASKS = ("sft", "dpo", "dpo-precomputed", "grpo", "rloo")
# "dpo-precomputed": DPOConfig(precompute_ref_log_probs=True): no reference held or run during training,
# its per-pair sums come with the data (training/dpo/precompute.py)
HOLDS_REFERENCE = ("dpo", "grpo", "rloo")
# per-token statistics the objective reads from the head (dpo: entropy, mean logit, top-1; grpo/rloo: entropy)
_STATS = {"dpo": 3, "dpo-precomputed": 3, "grpo": 1, "rloo": 1}
# bytes per token of the objective's inputs held through the step: GRPO's fp64 rows (weight, advantage,
# reference log-probs, completion index, target-aligned); RLOO's and the old policy's log-probs, which TRL
# 1.16's RLOOTrainer always scores (a second no-grad forward, the size of the reference's phase); DPO's
# reference log-probs (fp32)
_ROWS = {"dpo": 4, "dpo-precomputed": 0, "grpo": 4 * 8, "rloo": 5 * 8}


def head_forward_terms(z: Sizes, dims, S: float, lr: int, stats: int) -> dict:
    """The log-prob head's forward on one chunk of `lr` rows: the chunk's fp32 logits / T and
    its log-softmax (the compute-dtype logits are freed by then); its outputs per token."""
    return {"final norm output (LM head input)": z.v * S,
            "per-token log-probs and statistics (fp32)": 4 * (1 + stats) * S,
            "log-prob chunk forward: fp32 logits and log-softmax": 8 * lr * dims.vocab}


def head_backward_terms(z: Sizes, dims, S: float, lr: int) -> dict:
    """The log-prob head's backward on one chunk: the recomputed logits (compute dtype) beside the
    fp32 logits and the log-softmax the gradient is then written over (`ops/chunked_logprobs
    ._logits_grad`), the fp32 sum each chunk's weight-gradient GEMM writes into (ops/grad_sums.py:
    no weight-sized gradient per chunk), and the gradient of the head's input."""
    v_, h = dims.vocab, dims.hidden
    return {"final norm output (LM head input)": z.v * S, "gradient of the LM head input": z.v * S,
            "log-prob chunk backward: recomputed logits, fp32 logits and log-softmax": (z.dt + 8) * lr * v_,
            "LM-head weight gradient (fp32 sum)": 4 * v_ * h}


def reference_phases(z: Sizes, dims, s, S: float, r: float, lr: int) -> tuple[dict, dict]:
    """The frozen reference's forward (no gradients) in its two peaks, which never coexist: a
    layer's (its input, output and norm output, its attention inputs and output (FPDT: one
    chunk's; else the whole sequence's q, k, v and output), an MLP row chunk) and then the log-prob
    head's (the final norm output and one chunk's fp32 logits and log-softmax)."""
    c = S / s.fpdt_chunks if s.fpdt_chunks > 1 else S
    layers = {"reference: layer input, output and norm output": 3 * z.v * S,
              "reference: q, k, v and attention output": (2 * z.qb + 2 * z.kvb) * c,
              "reference: MLP chunk (I-wide)": 3 * z.ib * r}
    head = {"reference: final norm output (LM head input)": z.v * S,
            "reference: log-prob chunk forward": 8 * lr * dims.vocab}
    return layers, head


def with_task(budget: Budget, task: str, dims, s, z: Sizes, S: float, r: float, lr: int) -> Budget:
    """`budget` (SFT's, setting `s`) for `task`: SFT's loss terms replaced by the log-prob head's
    forward and backward phases, the objective's per-token inputs held, the reference's forward."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if task == "sft":
        return budget
    lr = lr if s.loss_chunks != 1 else loss_rows(dims, int(S), 0, s.loss_chunk_rows)  # the log-prob head: always chunked
    sft_loss = set(loss_terms(z, dims, S, lr, True)) | set(loss_terms(z, dims, S, lr, False))
    rows = {"objective inputs per token (log-probs, weights, advantages)": _ROWS[task] * S}
    held = {**rows}
    phases = []
    for p in budget.phases:
        if p.name != "loss":
            phases.append(Phase(p.name, p.terms | held))
            continue
        base = {k: b for k, b in p.terms.items() if k not in sft_loss}
        phases.append(Phase("loss", base | held | head_forward_terms(z, dims, S, lr, _STATS[task])))
        phases.append(Phase("log-prob head backward", base | held | head_backward_terms(z, dims, S, lr)))
    if task in HOLDS_REFERENCE:
        layers, head = reference_phases(z, dims, s, S, r, lr)
        phases.append(Phase("reference forward: layers", held | layers))
        phases.append(Phase("reference forward: log-prob head", held | head))
    return replace(budget, phases=tuple(phases), held=budget.held + float(sum(held.values())))


def generation_bytes(dims, dt: int, tokens: int) -> float:
    """`estimate_memory(rollout_tokens=)` with task "grpo" / "rloo": device bytes above the sharded
    weights while a GPU generates `tokens` (prompt + completion of its rows per step) with the policy's own `generate` (`grpo/generate.unpatched_for_generation`): the
    whole model gathered in the compute dtype, the KV cache of every layer, and one layer's
    prefill over the prompt without sequence parallelism (hidden states, q, k, v, attention
    output, the MLP's I-wide tensors). Rollouts elsewhere (a server): 0."""
    kv = dims.layers * 2 * dims.kv_heads * dims.head_dim * dt
    q = dims.heads * dims.head_dim * dt
    prefill = 3 * dims.hidden * dt + 2 * q + 2 * dims.kv_heads * dims.head_dim * dt + 4 * dims.intermediate * dt
    return dt * dims.params + (kv + prefill) * tokens


def rollout_tokens_within(dims, dt: int, memory, rollout_tokens: int, usable: float) -> int:
    """The most rollout tokens per GPU whose generation phase fits in `usable` device bytes at the
    setting of `memory` (an `estimate.MemoryEstimate` with `rollout_tokens` charged): the phase
    is linear in its tokens beside the shards that stay (parameters, optimizer states, held
    gradients); 0 when not even the gathered model fits there."""
    per_token = generation_bytes(dims, dt, 1) - generation_bytes(dims, dt, 0)
    fixed = memory.params + memory.optimizer + memory.held + memory.generation - per_token * rollout_tokens
    return max(0, int((usable - fixed) // per_token))

