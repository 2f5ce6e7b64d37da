"""Pretraining / continued pretraining of a Hugging Face causal LM on long documents.

Run, e.g. one node of 8 GPUs with Ulysses 4 × ring 2:
    accelerate launch --config_file accelerate_configs/gpu_1node_8.yaml recipes/pretrain.py \
        --model meta-llama/Llama-3.2-1B --dataset text --data-files 'corpus/*.txt' --sample-by document \
        --ulysses 4 --ring 2 --tokens-per-step 1048576 --max-tokens 131072 --steps 1000 --output-dir runs/pt

`hf_longctx.LongContextTrainer` (a `transformers.Trainer`) does the rest: step sampler →
cost-balanced plan (Hydraulis / FlexSP) → USP / FPDT micro-batches → FSDP2 over DP × SP
(USP "Tip 3") with summed gradients → the Trainer's AdamW + cosine schedule, logging,
sharded `checkpoint-N/` saves; `--resume` continues from the newest one. `recipes/lora.py`
is this recipe plus a PEFT adapter. Works on CUDA/NCCL (each rank on its LOCAL_RANK GPU) and
on CPU/gloo.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling module, also under accelerate launch

from common import add_common_args, check_common_args, patch_kwargs, trainer_kwargs  # noqa: E402
from shared_files import fill_caches_in_turn  # noqa: E402

from hf_longctx import LongContextTrainer, init_sequence_parallel, patch, tokenize_dataset  # noqa: E402
from hf_longctx._compat import checkpointing_fields  # noqa: E402
from hf_longctx.training.launch import describe, init_distributed, run_rank  # noqa: E402


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", required=True, help="from_pretrained path or hub id")
    p.add_argument("--dataset", required=True, help="datasets builder or hub id, e.g. text, json, parquet")
    p.add_argument("--data-files", nargs="*", default=None)
    p.add_argument("--sample-by", default=None, help="for the text builder: 'document' keeps one file per row")
    p.add_argument("--split", default="train")
    p.add_argument("--text-column", default="text")
    p.add_argument("--activation-checkpointing", action="store_true", help="patch(checkpoint=True); not with --memory")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--tokens-per-step", type=int, required=True, help="global tokens per optimizer step")
    p.add_argument("--max-tokens", type=int, required=True, help="tokens of one micro-batch of one SP group")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--export", action="store_true", help="at the end, save_pretrained the full model to output-dir/final")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a collective may block before all ranks stop")
    p.add_argument("--step-timeout", type=float, default=None, help="watchdog: seconds without progress before exiting")
    p.add_argument("--seed", type=int, default=0)
    return add_common_args(p)


def parse_args(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    args = check_common_args(p, p.parse_args(argv))
    if args.memory is not None and args.activation_checkpointing:
        p.error(f"--memory {args.memory} and --activation-checkpointing together: the preset decides checkpointing "
                "('max' checkpoints); pass one of them")
    return args


def run(args: argparse.Namespace, wrap: Callable[[Any], Any] | None = None) -> None:
    """The recipe; `wrap(model)` may replace the model before patching (LoRA)."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments

    device = init_distributed(timeout_s=args.timeout)  # LOCAL_RANK's device + the process group
    targs = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, learning_rate=args.lr, warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay, lr_scheduler_type="cosine", max_grad_norm=1.0, logging_steps=1,
        save_strategy="steps", save_steps=args.save_every, seed=args.seed, bf16=args.mixed_precision == "bf16",
        use_cpu=device.type == "cpu", report_to=[],
    )
    if args.activation_checkpointing:  # mapped to patch(checkpoint=True); the field is named per transformers release
        setattr(targs, checkpointing_fields(targs)[0], True)
    mesh = init_sequence_parallel(ulysses_degree=args.ulysses, ring_degree=args.ring, fpdt_chunks=args.fpdt_chunks)
    if targs.process_index == 0:
        print(describe(mesh, device, param_offload=args.param_offload))
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    extra = {"sample_by": args.sample_by} if args.sample_by else {}
    with fill_caches_in_turn():  # rank 0, then one rank per node, download and fill the datasets cache
        raw = load_dataset(args.dataset, data_files=args.data_files, split=args.split, **extra)
        data = tokenize_dataset(raw, tokenizer, text_column=args.text_column)
    # fp32 master weights: the FSDP plan casts to bf16 for compute (MixedPrecisionPolicy).
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if wrap is not None:
        model = wrap(model)
    patch(model, mesh, **patch_kwargs(args))
    trainer = LongContextTrainer(
        model=model, args=targs, train_dataset=data, processing_class=tokenizer, mesh=mesh, max_tokens=args.max_tokens,
        tokens_per_step=args.tokens_per_step, overlong="split", step_timeout_s=args.step_timeout, **trainer_kwargs(args),
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if args.export:
        trainer.save_model(os.path.join(args.output_dir, "final"))  # consolidated; a PEFT model saves its adapter


if __name__ == "__main__":
    run_rank(lambda: run(parse_args(build_parser(__doc__.split("\n")[0]))))  # exits without finalisation (training/launch.py)
