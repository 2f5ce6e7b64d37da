"""DPO under sequence parallelism with hf_longctx's building blocks (issue 21, item 5).

Run (CPU, gloo, or GPUs):
  accelerate launch --num_processes 4 recipes/dpo.py MODEL pairs.jsonl --ulysses 2 --ring 2 --steps 2
pairs.jsonl: one {"prompt": [ids], "chosen": [ids], "rejected": [ids]} per line (token ids).
Flow: plan_pairs (a pair is one unit) -> pack_pairs -> shard_batch -> patched policy and
reference (a frozen copy of the initial model, TRL's default) -> completion_logps (doc_sums)
-> dpo_loss over the step's GLOBAL pairs -> sum_gradients -> AdamW. A plain loop; the same
through TRL's DPOTrainer is hf_longctx.LongDPOTrainer (training/dpo_trainer.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from accelerate import PartialState
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling module, also under accelerate launch
from common import add_common_args, check_common_args, patch_kwargs, refuse_flags  # noqa: E402
from hf_longctx import init_sequence_parallel, pack_pairs, patch, plan_pairs, shard_batch  # noqa: E402
from hf_longctx.loss import global_loss, sum_gradients  # noqa: E402
from hf_longctx.training.dpo_loss import LOSS_TYPES, completion_logps, dpo_loss  # noqa: E402
from hf_longctx.training.launch import run_rank  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model"), p.add_argument("pairs")
    p.add_argument("--steps", type=int, default=1), p.add_argument("--pairs-per-step", type=int, default=4)
    p.add_argument("--beta", type=float, default=0.1), p.add_argument("--loss-type", choices=LOSS_TYPES, default="sigmoid")
    p.add_argument("--lr", type=float, default=1e-4), p.add_argument("--max-tokens", type=int, default=4096)
    args = check_common_args(p, add_common_args(p, mixed_precision="fp32").parse_args())
    refuse_flags(p, args, {
        "sync_each_microbatch": "leave it off (one micro-batch per step here)",
        "param_offload": "leave it off (the plain loop keeps the model on the device)",
        "resume": "start a new run (this loop writes no checkpoints)",
        "tokenizer": "pass token ids (the recipe reads no text)",
    })
    if args.mixed_precision != "fp32":
        p.error("recipes/dpo.py runs fp32 only (--mixed-precision fp32)")
    PartialState(cpu=not torch.cuda.is_available())  # the process group accelerate launch describes
    mesh = init_sequence_parallel(args.ulysses, args.ring, args.fpdt_chunks)
    pairs = [json.loads(line) for line in open(args.pairs) if line.strip()]
    if len(pairs) < args.steps * args.pairs_per_step or args.pairs_per_step < mesh.dp:
        p.error(f"{len(pairs)} pairs for --steps {args.steps} x --pairs-per-step {args.pairs_per_step} "
                f"(needs >= dp = {mesh.dp} pairs per step): give more pairs or fewer steps")
    model = patch(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).train(), mesh, **patch_kwargs(args))
    ref = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval().requires_grad_(False)
    ref = patch(ref, mesh, **patch_kwargs(args))  # TRL's default reference: the initial policy, same mesh
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        batch = pairs[step * args.pairs_per_step : (step + 1) * args.pairs_per_step]
        full = [(q["prompt"] + q["chosen"], q["prompt"] + q["rejected"]) for q in batch]
        plan = plan_pairs([len(c) for c, _ in full], [len(r) for _, r in full], dp_size=mesh.dp,
                          max_tokens=args.max_tokens, doc_multiple=mesh.doc_multiple, seq_multiple=mesh.seq_multiple)
        metrics = torch.zeros(4, dtype=torch.float64)
        step_loss = torch.zeros((), dtype=torch.float64)
        opt.zero_grad(set_to_none=True)
        for mb in plan.ranks[mesh.dp_rank]:
            if not mb:
                continue  # the SP group's ranks share the plan: all of them skip together
            chosen = [batch[plan.pieces[i].doc] for i in mb]
            shard = shard_batch(pack_pairs([(q["prompt"], q["chosen"], q["rejected"]) for q in chosen]), mesh)
            shard.pop("labels"), shard.pop("num_items_in_batch")  # the model's token loss is not the objective
            sums, counts = completion_logps(model(**shard).logits, shard, mesh)
            with torch.no_grad():
                ref_sums, _ = completion_logps(ref(**shard).logits, shard, mesh)
            loss, m = dpo_loss(sums, ref_sums, beta=args.beta, loss_type=args.loss_type,
                               global_pairs=len(batch), sp=mesh.sp, counts=counts)
            loss.backward()
            step_loss += loss.detach().double()
            metrics += torch.stack([v.double() for v in m.values()])
        sum_gradients(model.parameters(), mesh)
        opt.step()
        total = global_loss(step_loss, mesh)
        if mesh.dp > 1:
            dist.all_reduce(metrics, group=mesh.dp_group)  # [4] sums over every pair of the step
        if dist.get_rank() == 0:
            means = {k: round(v / len(batch), 6) for k, v in zip(m, metrics.tolist())}
            print({"step": step + 1, "loss": round(total.item(), 6), **means}, flush=True)


if __name__ == "__main__":
    run_rank(main)  # exits without interpreter finalisation (hf_longctx/training/launch.py)
