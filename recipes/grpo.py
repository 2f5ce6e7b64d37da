"""GRPO (DeepSeekMath §4.1) on long completions under sequence parallelism, with TRL's loss semantics.

Run on CPU (gloo), a tiny random Llama, a locally made prompt set and the reward below:
    accelerate launch --config_file accelerate_configs/cpu_4proc.yaml recipes/grpo.py --ulysses 2 --steps 3
    torchrun --nproc-per-node 2 recipes/grpo.py --ulysses 2 --steps 3
or a real model: --model PATH (its config's vocabulary bounds the made-up prompts).

Each step: every DP group takes its own --prompts-per-group prompts; its SP group generates
--num-generations completions per prompt on gathered weights (training/grpo_generate.py:
ranks may decode different lengths, no hang), the reward below scores them, the
group-relative advantages follow TRL's default, and the training step runs under SP with
TRL's GRPOConfig loss (--loss-type grpo | dr_grpo | dapo, --beta for the KL to a frozen
reference copy) exactly as one process would (training/grpo_loss.py). The printed metrics
are global (TRL's names). A script on TRL's own GRPOTrainer (its dataset, reward functions
and logging) uses hf_longctx.LongGRPOTrainer instead (README "#### GRPO").
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling module, also under accelerate launch

from common import add_common_args, check_common_args, patch_kwargs, refuse_flags  # noqa: E402

from hf_longctx import fsdp_plan, init_sequence_parallel, patch  # noqa: E402
from hf_longctx.training.grpo import grpo_step  # noqa: E402
from hf_longctx.training.grpo_arguments import generation_kwargs  # noqa: E402
from hf_longctx.training.grpo_generate import hf_generate  # noqa: E402
from hf_longctx.training.grpo_loss import GRPOObjective  # noqa: E402
from hf_longctx.training.launch import describe, init_distributed, run_rank  # noqa: E402

EOS = 2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="from_pretrained path; default: a tiny random Llama (CPU demo)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts-per-group", type=int, default=3, help="prompts per DP group per step")
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=24)
    p.add_argument("--loss-type", default="dapo", help="GRPOConfig.loss_type (grpo, dr_grpo, dapo)")
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient to a frozen copy of the initial model")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="runs/grpo")
    add_common_args(p, mixed_precision="fp32")
    args = check_common_args(p, p.parse_args(argv))
    refuse_flags(p, args, {
        "sync_each_microbatch": "leave it off (one micro-batch per step here)",
        "param_offload": "leave it off (the plain loop keeps the model on the device)",
        "resume": "start a new run (this loop writes no checkpoints)",
        "tokenizer": "pass token ids (the recipe reads no text)",
    })
    return args


def reward(prompts: list[list[int]], completions: list[list[int]]) -> list[float]:
    """A format reward written for the demo: ends with EOS (+1), and the share of even token ids."""
    return [float(bool(c) and c[-1] == EOS) + sum(t % 2 == 0 for t in c) / max(len(c), 1) for c in completions]


def load_model(args):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if args.model is not None:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, eos_token_id=EOS, pad_token_id=0, bos_token_id=1)
    return AutoModelForCausalLM.from_config(cfg)


def main(argv=None) -> None:
    from trl import GRPOConfig

    args = parse_args(argv)
    device = init_distributed()
    # TRL's own config: every field is checked (grpo_arguments.py) before the objective is built.
    config = GRPOConfig(output_dir=args.output_dir, loss_type=args.loss_type, beta=args.beta, temperature=args.temperature,
                        max_completion_length=args.max_completion_length, num_generations=args.num_generations,
                        use_cpu=device.type == "cpu", bf16=args.mixed_precision == "bf16", report_to=[], seed=args.seed)
    objective = GRPOObjective.from_config(config)
    sample = hf_generate(max_new_tokens=config.max_completion_length, eos_token_id=EOS, **generation_kwargs(config))
    mesh = init_sequence_parallel(ulysses_degree=args.ulysses, ring_degree=args.ring, fpdt_chunks=args.fpdt_chunks)
    if mesh.rank == 0:
        print(describe(mesh, device))
    base = load_model(args)
    ref_model = patch(copy.deepcopy(base).eval(), mesh) if args.beta != 0.0 else None
    model = patch(base, mesh, **patch_kwargs(args))
    if mesh.world_size > 1:
        fsdp_plan(model, mesh, mixed_precision=args.mixed_precision).apply(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    for step in range(1, args.steps + 1):
        # The same draw on every rank; each DP group takes its own slice (its SP ranks the same one).
        lengths = torch.randint(4, 12, (mesh.dp * args.prompts_per_group,), generator=g).tolist()
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
        mine = prompts[mesh.dp_rank * args.prompts_per_group:(mesh.dp_rank + 1) * args.prompts_per_group]

        def generate(m, prompt, n, _step=step):  # sampling seeded by step and prompt: any rank draws the same
            torch.manual_seed(args.seed * 1_000_003 + _step * 7919 + sum(prompt))
            return sample(m, prompt, n)

        logs = grpo_step(model, optimizer, mesh, mine, reward, objective, num_generations=args.num_generations,
                         generate=generate, ref_model=ref_model, max_grad_norm=config.max_grad_norm)
        if mesh.rank == 0:
            print(f"step {step}: " + ", ".join(f"{k}={v:.4g}" for k, v in logs.items()), flush=True)


if __name__ == "__main__":
    run_rank(main)  # exits without interpreter finalisation (hf_longctx/training/launch.py)
