"""The counted step of each training task for the memory census: SFT's loss, DPO's and GRPO's
objectives with the frozen reference's forward, each as the library's trainers run them.

Where it sits: inside `benchmarks/memory_budget.measure_lengths` (`--task`), under the census.
`batch(task, ids, mesh)` lays `tokens` ids out as the task's packed row (SFT: one document;
DPO: one pair whose chosen document holds all but 16 tokens, so attention sees one long
document as the planner budgets; GRPO: one prompt + completion, half each) and shards it;
`step(task, model, ref, shard, mesh)` runs the forward(s) and the backward: the reference's
forward (no grad) first, then the policy's (`LongDPOTrainer.compute_loss`'s and
`grpo/loss.py`'s calls), as in a training step."""

from __future__ import annotations

import torch

TASKS = ("sft", "dpo", "grpo")
_REJECTED, _PROMPT = 8, 8  # the DPO pair's short document: prompt + rejected completion


def _objective():
    from hf_longctx.training.grpo.loss import GRPOObjective

    return GRPOObjective(loss_type="dapo", beta=0.04, temperature=0.7)


def batch(task: str, ids: torch.Tensor, mesh) -> dict:
    """This rank's shard of `ids` [1, tokens] laid out for `task`."""
    from hf_longctx import shard_batch

    row = ids[0].tolist()
    if task == "sft":
        return shard_batch({"input_ids": ids, "labels": ids.clone()}, mesh)
    if task == "dpo":
        from hf_longctx.data.pairs import pack_pairs

        prompt, rejected = row[:_PROMPT], row[_PROMPT : _PROMPT + _REJECTED]
        chosen = row[_PROMPT + _REJECTED :][: len(row) - 2 * _PROMPT - _REJECTED]
        return shard_batch(pack_pairs([(prompt, chosen, rejected)]), mesh, 1)
    if task == "grpo":
        from hf_longctx.training.grpo.loss import pack_completions, shard_completions

        half = len(row) // 2
        packed = pack_completions([row[:half]], [row[half:]], [0.5], _objective(), num_sequences=1,
                                  num_tokens=len(row) - half)
        return shard_completions(packed, mesh)
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")


def step(task: str, model, ref, shard: dict, mesh) -> None:
    """One forward + backward of `task` on `shard` (`ref`: the patched frozen reference, or None for SFT)."""
    if task == "sft":
        model(**shard).loss.backward()
    elif task == "dpo":
        from hf_longctx.integrations.logprob_head import token_logprobs
        from hf_longctx.training.dpo.loss import TOKEN_STATS, completion_sums, dpo_loss, stats_metric_sums

        with torch.no_grad():
            ref_token, _ = token_logprobs(ref, shard)
            reference = completion_sums(ref_token, shard, mesh)[0]  # [2]
            del ref_token
        token, stats = token_logprobs(model, shard, stats=TOKEN_STATS)
        policy, counts = completion_sums(token, shard, mesh)
        loss, _ = dpo_loss(policy, reference, beta=0.1, loss_type="sigmoid", global_pairs=1, sp=mesh.sp, counts=counts)
        stats_metric_sums(stats, shard, mesh)
        loss.backward()
    else:
        from hf_longctx.training.grpo.loss import add_ref_logps, grpo_loss

        add_ref_logps(ref, shard, _objective())
        loss, _ = grpo_loss(model, shard, _objective(), mesh, num_sequences=1)
        loss.backward()
