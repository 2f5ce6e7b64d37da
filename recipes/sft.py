"""Supervised fine-tuning on long prompt–completion (or conversational) data with TRL's SFTTrainer.

Run, e.g. one node of 8 GPUs with Ulysses 8:
    accelerate launch --config_file accelerate_configs/gpu_1node_8.yaml recipes/sft.py \
        --model Qwen/Qwen2.5-0.5B-Instruct --dataset json --data-files long_sft.jsonl --ulysses 8 \
        --tokens-per-step 524288 --max-tokens 131072 --steps 500 --output-dir runs/sft --export
or on CPU (gloo): torchrun --nproc-per-node 2 recipes/sft.py ... --ulysses 2

The dataset has `prompt`/`completion` columns (or `messages`); TRL tokenizes it and masks the
prompt (`completion_only_loss`, or `--assistant-only-loss` with a chat template), and
`LongContextTrainerMixin` in front of `SFTTrainer` trains it exactly under SP: documents are
never truncated (`max_length=None`; the cap is `--max-tokens`, longer ones are split into
pieces), our planner packs them (TRL packing off), TRL's activation checkpointing becomes
`patch(checkpoint=True)`, and `entropy` / `mean_token_accuracy` are global token means.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling module, also under accelerate launch

from common import add_common_args, check_common_args, checkpointing, patch_kwargs, trainer_kwargs  # noqa: E402
from shared_files import fill_caches_in_turn  # noqa: E402

from hf_longctx import LongContextTrainerMixin, init_sequence_parallel, patch  # noqa: E402
from hf_longctx.training.launch import describe, init_distributed, run_rank  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="from_pretrained path or hub id")
    p.add_argument("--dataset", required=True, help="datasets builder or hub id (json, parquet, ...)")
    p.add_argument("--data-files", nargs="*", default=None)
    p.add_argument("--split", default="train")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--tokens-per-step", type=int, required=True, help="global tokens per optimizer step")
    p.add_argument("--max-tokens", type=int, required=True, help="tokens of one micro-batch of one SP group")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--assistant-only-loss", action="store_true", help="conversational data: train on assistant turns")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--export", action="store_true", help="at the end, save_pretrained the full model to output-dir/final")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a collective may block before all ranks stop")
    p.add_argument("--seed", type=int, default=0)
    add_common_args(p)
    return check_common_args(p, p.parse_args(argv))


def main(argv=None) -> None:
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    class LongSFTTrainer(LongContextTrainerMixin, SFTTrainer):
        """TRL's SFTTrainer with exact sequence-parallel training."""

    args = parse_args(argv)
    device = init_distributed(timeout_s=args.timeout)
    config = SFTConfig(
        output_dir=args.output_dir, max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="cosine",
        max_grad_norm=1.0, logging_steps=1, save_strategy="steps", save_steps=args.save_every, seed=args.seed,
        bf16=args.mixed_precision == "bf16", use_cpu=device.type == "cpu", report_to=[],
        max_length=None, packing=False, padding_free=False,  # hf_longctx caps (max_tokens) and packs
        assistant_only_loss=args.assistant_only_loss, **checkpointing(True),  # TRL's default, under its current name
    )
    mesh = init_sequence_parallel(ulysses_degree=args.ulysses, ring_degree=args.ring, fpdt_chunks=args.fpdt_chunks)
    if config.process_index == 0:
        print(describe(mesh, device, param_offload=args.param_offload))
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    with fill_caches_in_turn():  # rank 0, then one rank per node, fill the datasets cache
        data = load_dataset(args.dataset, data_files=args.data_files, split=args.split)
    model = patch(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32), mesh, **patch_kwargs(args))
    trainer = LongSFTTrainer(
        model=model, args=config, train_dataset=data, processing_class=tokenizer, mesh=mesh,
        max_tokens=args.max_tokens, tokens_per_step=args.tokens_per_step, overlong="split", **trainer_kwargs(args),
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if args.export:
        trainer.save_model(os.path.join(args.output_dir, "final"))


if __name__ == "__main__":
    run_rank(main)  # exits without interpreter finalisation (hf_longctx/training/launch.py)
