"""GRPO (DeepSeekMath §4.1) on long completions with TRL's GRPOTrainer, exact under sequence parallelism.

Run on CPU (gloo) with a tiny Llama built here, locally made prompts and the reward below:
    accelerate launch --config_file accelerate_configs/cpu_4proc.yaml recipes/grpo.py --ulysses 2 --beta 0.04
    accelerate launch --multi_gpu --num_processes 2 recipes/grpo.py --ulysses 2 --steps 2
or a real model and a prompt dataset (a `prompt` column, text or conversational):
    accelerate launch --config_file accelerate_configs/gpu_1node_8.yaml recipes/grpo.py --model PATH \
        --dataset json --data-files prompts.jsonl --ulysses 8 --num-generations 8 --max-completion-length 32768 \
        --steps 500 --mixed-precision bf16 --output-dir runs/grpo --export

Where it sits: the user's path, a TRL GRPOTrainer script plus `mesh=`. Without --model the
recipe builds a tiny Llama and a word-level tokenizer from a config (`common.build_tiny_model`:
`save_pretrained`, then every rank `from_pretrained`s it); without --dataset it makes
--prompts text prompts. `hf_longctx.LongGRPOTrainer` then trains with TRL's own pieces -- its
sampler (each process draws --per-device-train-batch-size rows of the step), generation (on
gathered, unpatched weights: ranks may decode different lengths without a hang), the reward
function below (`format_scores`), group advantages and logging -- and the training step under SP: the SP group
trains on the union of its ranks' rows as one packed, sharded row (--max-tokens N: several
packed micro-batches of <= N tokens with gradient accumulation, the same result), with GRPOConfig's loss
(--loss-type grpo | dr_grpo | dapo; --beta > 0: KL to TRL's reference, the initial model
loaded again, patched and sharded like the policy), FSDP2 summing the gradients over DP x SP.
Every step prints TRL's metrics (loss, grad_norm, reward, reward_std, kl, entropy,
clip_ratio/*, completions/*) as global values; every rank writes them to
OUTPUT_DIR/steps.rank<R>.jsonl. Refused (LongGRPOTrainer does not make them exact):
--memory (its chunked LM head drops the logits the loss needs), --sync-each-microbatch (FSDP2
reduce-scatters after every micro-batch already) and --param-offload (no host offload). --save-every N
writes sharded checkpoint-N/ folders (policy and optimizer shards of every rank, scheduler, RNG; the
frozen reference is rebuilt from --model, so resume with the same --model); --resume continues from
the newest one exactly as the uninterrupted run would; --export saves the trained model.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling module, also under accelerate launch

from common import (  # noqa: E402
    add_model_data_args, checkpointing, load_model_and_data, parse_post_training_args,
    patch_kwargs, recipe_mesh, step_lines, train_and_export,
)

from hf_longctx import LongGRPOTrainer, patch  # noqa: E402
from hf_longctx.training.launch import init_distributed, run_rank  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_data_args(p, data="prompts (a `prompt` column)")
    p.add_argument("--prompts", type=int, default=64, help="prompts of the locally made dataset (without --dataset)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--per-device-train-batch-size", type=int, default=4,
                   help="rows (prompt x generation) each process draws per step; times the processes: a multiple "
                        "of --num-generations")
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens of one packed micro-batch of an SP group: the step's rows split into micro-batches "
                        "with gradient accumulation (LongGRPOTrainer(max_tokens=)); default: one micro-batch per step")
    p.add_argument("--loss-type", default="dapo", help="GRPOConfig.loss_type (grpo, dr_grpo, dapo)")
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient to TRL's reference (the initial model)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-3)
    return parse_post_training_args(p, argv, output_dir="runs/grpo", refused={
        "memory": "leave it off (its chunked LM head drops the logits the GRPO loss needs); for K/V offload "
                  "use --fpdt-chunks N --kv-offload",
        "sync_each_microbatch": "leave it off (LongGRPOTrainer's FSDP2 reduce-scatters the gradients after every "
                                "micro-batch of --max-tokens already)",
        "param_offload": "leave it off (LongGRPOTrainer keeps the FSDP2 shards on the device)",
    })


def format_scores(completion_ids: list[list[int]], eos_token_id: int) -> list[float]:
    """The recipe's reward: +1 for a completion that ends with EOS (it finished), plus the share
    of its tokens with an even id (a stand-in for a format rule); one value per completion."""
    return [float(bool(c) and c[-1] == eos_token_id) + sum(t % 2 == 0 for t in c) / max(len(c), 1)
            for c in completion_ids]


def make_prompts(n: int, seed: int, vocab_words: int = 126):
    """`n` text prompts of 3..11 words of the tiny tokenizer ("w0".."w125")."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (n,), generator=g).tolist()
    words = lambda k: " ".join(f"w{i}" for i in torch.randint(0, vocab_words, (k,), generator=g).tolist())  # noqa: E731
    return Dataset.from_dict({"prompt": [words(k) for k in lengths]})


def main(argv=None) -> None:
    from trl import GRPOConfig

    args = parse_args(argv)
    device = init_distributed(timeout_s=args.timeout)  # LOCAL_RANK's device + the process group
    config = GRPOConfig(
        output_dir=args.output_dir, max_steps=args.steps, learning_rate=args.lr, max_grad_norm=1.0, logging_steps=1,
        save_strategy="steps" if args.save_every else "no", save_steps=args.save_every or 500, seed=args.seed,
        bf16=args.mixed_precision == "bf16", use_cpu=device.type == "cpu",
        report_to=[], disable_tqdm=True, **checkpointing(False),
        per_device_train_batch_size=args.per_device_train_batch_size, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, loss_type=args.loss_type, beta=args.beta,
        temperature=args.temperature,
    )
    mesh = recipe_mesh(args, config, device)
    model, tokenizer, prompts = load_model_and_data(args, config, lambda a: make_prompts(a.prompts, a.seed))

    def format_reward(completion_ids, **kwargs):  # TRL: the sampled ids of this process's completions; logs
        return format_scores(completion_ids, tokenizer.eos_token_id)  # rewards/format_reward/mean|std

    trainer = LongGRPOTrainer(
        model=patch(model, mesh, **patch_kwargs(args)), mesh=mesh, reward_funcs=[format_reward], args=config,
        train_dataset=prompts, processing_class=tokenizer, max_tokens=args.max_tokens,
        callbacks=[step_lines(args.output_dir, config.process_index, config.process_index == 0)],
    )
    train_and_export(trainer, args)


if __name__ == "__main__":
    run_rank(main)  # exits without interpreter finalisation (hf_longctx/training/launch.py)
