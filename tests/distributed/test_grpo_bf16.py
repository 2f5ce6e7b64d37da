"""GRPO step under SP with bf16 weights (training/grpo/loss.py) within the project's bf16 rule
(tests/helpers/bf16_rule.py): per gradient tensor (tensors under SMALL entries pooled)
‖ours − truth‖ ≤ 2·‖single − truth‖ + 1e-6·‖truth‖, the loss (a scalar) within the
single-process error plus one bf16 rounding (`scalar_excess`), where truth is the unpatched
model in float64 on the same bf16-rounded weights and single the unpatched bf16 model in one
process, both with TRL's formulas (tests/helpers/grpo_reference.py). One configuration: U2×R2,
loss_type "dapo", beta 0.04, injected old log-probabilities (clipping active)."""

from __future__ import annotations

import torch

from tests.helpers.bf16_rule import criterion, pooled_small, scalar_excess
from tests.helpers.grpo_reference import EPS_HIGH, EPS_LOW, MAX_LEN, TEMPERATURE, injected, make_rollouts, reference_step
from tests.helpers.families import save_family
from tests.helpers.pool import worker_mesh

CASE = ("dapo", 0.04, True, True, None)


def _bf16_step(path: str) -> dict:
    from transformers import AutoModelForCausalLM

    from hf_longctx.integrations.model_patch import patch
    from hf_longctx.distributed.loss import global_loss, sum_gradients
    from hf_longctx.training.grpo.loss import GRPOObjective, grpo_loss, pack_completions, shard_completions

    def fresh(dtype):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(dtype).train()

    rollouts = make_rollouts()
    prompts, completions, advantages, _, _ = rollouts
    rows = injected(fresh(torch.float32), rollouts, with_old=True)  # the same injected values for all three runs
    loss64, g64, _, _ = reference_step(fresh(torch.float64), rollouts, *CASE, rows=rows)
    loss1, g1, _, _ = reference_step(fresh(torch.bfloat16), rollouts, *CASE, rows=rows)
    mesh = worker_mesh(2, 2)
    obj = GRPOObjective(loss_type=CASE[0], epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, beta=CASE[1], temperature=TEMPERATURE,
                        max_completion_length=MAX_LEN)
    packed = pack_completions(prompts, completions, advantages, obj, num_sequences=len(completions),
                              num_tokens=sum(map(len, completions)), old_logps=rows[0], ref_logps=rows[1])
    model = patch(fresh(torch.bfloat16), mesh)
    loss, _ = grpo_loss(model, shard_completions(packed, mesh), obj, mesh, num_sequences=len(completions))
    loss.backward()
    sum_gradients(model.parameters(), mesh)
    g = {k: p.grad.detach().double() for k, p in model.named_parameters() if p.grad is not None}
    out = {name: criterion(t, s, r) for name, t, s, r in pooled_small([(n, g64[n], g1[n].double(), g[n]) for n in g64])}
    out["loss"] = scalar_excess(global_loss(loss, mesh).item(), loss1.item(), loss64.item())  # a scalar: no ratio rule
    return out


def test_grpo_bf16_within_twice_single_process_error(pools, tmp_path):
    path = save_family("llama", tmp_path)
    for rank, out in enumerate(pools.get(4).run(_bf16_step, path, timeout=300)):
        bad = {k: v for k, v in out.items() if v[0] > 0}
        assert not bad, f"rank {rank}: tensors beyond 2x the single-process bf16 error (excess, ratio): {bad}"
