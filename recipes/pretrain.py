"""Pretraining / continued pretraining of a Hugging Face causal LM on long documents.

Run, e.g. one node of 8 GPUs with Ulysses 4 × ring 2:
    accelerate launch --config_file accelerate_configs/gpu_1node_8.yaml recipes/pretrain.py \
        --model meta-llama/Llama-3.2-1B --dataset text --data-files 'corpus/*.txt' --sample-by document \
        --ulysses 4 --ring 2 --tokens-per-step 1048576 --max-tokens 131072 --steps 1000 --output-dir runs/pt

The shared loop of `hf_longctx.training` does the rest: step sampler → cost-balanced plan
(Hydraulis / FlexSP) → USP / FPDT micro-batches → FSDP2 over DP × SP (USP "Tip 3") with
summed gradients → AdamW + cosine; periodic sharded checkpoints, resumed automatically.
`recipes/lora.py` is this recipe plus a PEFT adapter.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

import torch

from hf_longctx.data.pipeline import tokenize_dataset
from hf_longctx.training.launch import describe, setup_distributed
from hf_longctx.training.loop import TrainConfig, train


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", required=True, help="from_pretrained path or hub id")
    p.add_argument("--tokenizer", default=None, help="default: --model")
    p.add_argument("--dataset", required=True, help="datasets builder or hub id, e.g. text, json, parquet")
    p.add_argument("--data-files", nargs="*", default=None)
    p.add_argument("--sample-by", default=None, help="for the text builder: 'document' keeps one file per row")
    p.add_argument("--split", default="train")
    p.add_argument("--text-column", default="text")
    p.add_argument("--ulysses", type=int, default=1)
    p.add_argument("--ring", type=int, default=1)
    p.add_argument("--fpdt-chunks", type=int, default=1)
    p.add_argument("--kv-offload", action="store_true", help="FPDT: offload KV chunks to host memory")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--tokens-per-step", type=int, required=True, help="global tokens per optimizer step")
    p.add_argument("--max-tokens", type=int, required=True, help="tokens of one micro-batch of one SP group")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--mixed-precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--param-offload", action="store_true", help="FSDP2 CPU offload of params/grads/optimizer states")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--export", action="store_true", help="at the end, save_pretrained the full model to output-dir/final")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a collective may block before all ranks stop")
    p.add_argument("--step-timeout", type=float, default=None, help="watchdog: seconds without progress before exiting")
    p.add_argument("--seed", type=int, default=0)
    return p


def export(model: torch.nn.Module, path: str, is_main: bool) -> None:
    """Gather the sharded model once (a collective) and `save_pretrained` it on rank 0
    (for a PEFT model only the adapter is written)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if is_main:
        model.save_pretrained(path, state_dict=state)


def run(args: argparse.Namespace, wrap: Callable[[Any], Any] | None = None) -> None:
    """The recipe; `wrap(model)` may replace the model before training (LoRA)."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    accelerator, mesh = setup_distributed(
        ulysses=args.ulysses, ring=args.ring, fpdt_chunks=args.fpdt_chunks, timeout_s=args.timeout, seed=args.seed
    )
    accelerator.print(describe(accelerator, mesh))
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    extra = {"sample_by": args.sample_by} if args.sample_by else {}
    with accelerator.main_process_first():  # rank 0 downloads / fills the cache first
        raw = load_dataset(args.dataset, data_files=args.data_files, split=args.split, **extra)
        data = tokenize_dataset(raw, tokenizer, text_column=args.text_column)
    # fp32 master weights: the FSDP plan casts to bf16 for compute (MixedPrecisionPolicy).
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if wrap is not None:
        model = wrap(model)
    config = TrainConfig(
        steps=args.steps, tokens_per_step=args.tokens_per_step, max_tokens=args.max_tokens, lr=args.lr,
        warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, seed=args.seed,
        mixed_precision=args.mixed_precision, param_offload=args.param_offload,
        output_dir=os.path.join(args.output_dir, "checkpoints"), save_every=args.save_every,
        step_timeout_s=args.step_timeout,
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    patch_options = {"kv_offload": args.kv_offload, "checkpoint": args.activation_checkpointing}
    result = train(model, data, mesh, config, pad_token_id=pad, patch_options=patch_options)
    if result.records:
        accelerator.print(
            f"done: loss {result.records[0].loss:.4f} -> {result.records[-1].loss:.4f}, {result.tokens} tokens "
            f"in {result.wall_s:.1f}s; checkpoint {result.checkpoint}"
        )
    if args.export:
        export(model, os.path.join(args.output_dir, "final"), accelerator.is_main_process)


if __name__ == "__main__":
    run(build_parser(__doc__.split("\n")[0]).parse_args())
