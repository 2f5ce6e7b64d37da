"""DPO on long preference pairs with TRL's DPOTrainer, exact under sequence parallelism (`LongDPOTrainer`).

Run on CPU (gloo) with a tiny Llama built here and locally made pairs:
    accelerate launch --config_file accelerate_configs/cpu_4proc.yaml recipes/dpo.py --ulysses 2 --ring 2 --steps 4
    accelerate launch --multi_gpu --num_processes 2 recipes/dpo.py --ulysses 2 --steps 2
or a real model and a pairs dataset (prompt/chosen/rejected as text, conversations or token-id lists):
    accelerate launch --config_file accelerate_configs/gpu_1node_8.yaml recipes/dpo.py --model PATH \
        --dataset json --data-files pairs.jsonl --ulysses 8 --tokens-per-step 262144 --max-tokens 65536 \
        --steps 500 --mixed-precision bf16 --output-dir runs/dpo --export

Where it sits: the user's path, a TRL DPOTrainer script plus `mesh=`. Without --model the
recipe builds a tiny Llama and a word-level tokenizer from a config (`common.build_tiny_model`:
`save_pretrained`, then every rank `from_pretrained`s it, as a real checkpoint loads); without
--dataset it makes --pairs text pairs (the chosen completion repeats the prompt's last word,
the rejected one is random words; TRL tokenizes them). `hf_longctx.LongDPOTrainer` then
trains: each step's pairs fill --tokens-per-step tokens (chosen and rejected counted), a pair
stays in one micro-batch (--max-tokens) of one SP group, the policy's and TRL's default
reference's (the initial model, loaded again from --model) log-probabilities are per-document
sums over the SP shards, the loss is the mean over the step's GLOBAL pairs, FSDP2 sums the
gradients over DP x SP. Every step prints TRL's metrics (loss, grad_norm, rewards/margins,
rewards/accuracies, logps/*, ...) as global values; every rank writes them to
OUTPUT_DIR/steps.rank<R>.jsonl. Every shared flag is honoured: --memory, --inputs-on-device,
--kv-offload (with --fpdt-chunks) and --mixers go to `patch` (policy and reference: the
log-probs come through the row-chunked LM head under every preset); --sync-each-microbatch,
--param-offload, --resume (with --save-every checkpoints) and --verify-ref-logps (with
--precompute-ref-log-probs: a --dataset's stored reference columns rescored on N pairs) to the
trainer.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling module, also under accelerate launch

from common import (  # noqa: E402
    add_model_data_args, checkpointing, load_model_and_data, parse_post_training_args,
    patch_kwargs, print_patch, recipe_mesh, step_lines, train_and_export, trainer_kwargs,
)

from hf_longctx import LongDPOTrainer, patch  # noqa: E402
from hf_longctx.training.dpo.loss import LOSS_TYPES  # noqa: E402
from hf_longctx.training.launch import init_distributed, run_rank  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_data_args(p, data="preference pairs")
    p.add_argument("--pairs", type=int, default=32, help="pairs of the locally made dataset (without --dataset)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--tokens-per-step", type=int, default=256, help="global tokens per optimizer step (both completions)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens of one micro-batch of one SP group")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--loss-type", choices=LOSS_TYPES, default="sigmoid")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--precompute-ref-log-probs", action="store_true",
                   help="score every pair with the reference once before training (DPOConfig.precompute_ref_log_probs); "
                        "no reference is held or run during training")
    p.add_argument("--verify-ref-logps", type=int, default=0, metavar="N",
                   help="with --precompute-ref-log-probs and a --dataset that carries TRL's stored reference columns: "
                        "rescore N sampled pairs with the reference and refuse columns that disagree (0: none)")
    args = parse_post_training_args(p, argv, output_dir="runs/dpo", refused={})  # every shared flag honoured
    if args.verify_ref_logps < 0:
        p.error(f"--verify-ref-logps {args.verify_ref_logps}: pass how many pairs to rescore (0: none)")
    if args.verify_ref_logps and not args.precompute_ref_log_probs:
        p.error(f"--verify-ref-logps {args.verify_ref_logps} rescores stored reference columns, which are read only "
                "with --precompute-ref-log-probs: add it, or drop --verify-ref-logps")
    return args


def dpo_trainer_kwargs(args: argparse.Namespace) -> dict:
    """The `LongDPOTrainer` options of the recipe's flags: the shared trainer options and
    `verify_ref_logps` (passed only when set, so the trainer's default stands otherwise)."""
    return {**trainer_kwargs(args), **({"verify_ref_logps": args.verify_ref_logps} if args.verify_ref_logps else {})}


def make_pairs(n: int, seed: int):
    """`n` text pairs over the tiny tokenizer's words: the chosen completion repeats the prompt's
    last word, the rejected one is random words; both end with <eos>."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    words = lambda k: [f"w{i}" for i in torch.randint(0, 126, (k,), generator=g).tolist()]  # noqa: E731
    rows = []
    for _ in range(n):
        prompt = words(int(torch.randint(3, 9, (1,), generator=g)))
        chosen = [prompt[-1]] * int(torch.randint(3, 12, (1,), generator=g))
        rejected = words(int(torch.randint(3, 12, (1,), generator=g)))
        rows.append({"prompt": " ".join(prompt), "chosen": " " + " ".join(chosen) + " <eos>",
                     "rejected": " " + " ".join(rejected) + " <eos>"})
    return Dataset.from_list(rows)


def main(argv=None) -> None:
    from trl import DPOConfig

    args = parse_args(argv)
    device = init_distributed(timeout_s=args.timeout)  # LOCAL_RANK's device + the process group
    config = DPOConfig(
        output_dir=args.output_dir, max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="cosine",
        max_grad_norm=1.0, logging_steps=1, save_strategy="steps" if args.save_every else "no",
        save_steps=args.save_every or 500, seed=args.seed, bf16=args.mixed_precision == "bf16",
        use_cpu=device.type == "cpu", report_to=[], disable_tqdm=True,
        max_length=None, beta=args.beta, loss_type=args.loss_type,  # the cap is --max-tokens; pairs are never cut
        precompute_ref_log_probs=args.precompute_ref_log_probs,
        **checkpointing(True),  # TRL's default, under its current name
    )
    mesh = recipe_mesh(args, config, device)
    model, tokenizer, pairs = load_model_and_data(args, lambda a: make_pairs(a.pairs, a.seed))
    trainer = LongDPOTrainer(
        model=patch(model, mesh, **patch_kwargs(args)), args=config, train_dataset=pairs, processing_class=tokenizer,
        mesh=mesh, max_tokens=args.max_tokens, tokens_per_step=args.tokens_per_step,  # ref_model=None: TRL's default
        callbacks=[step_lines(args.output_dir, config.process_index, config.process_index == 0)],
        **dpo_trainer_kwargs(args),
    )
    print_patch(trainer.model, config.process_index == 0)
    train_and_export(trainer, args)


if __name__ == "__main__":
    run_rank(main)  # exits without interpreter finalisation (hf_longctx/training/launch.py)
