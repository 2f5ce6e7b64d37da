"""CPU demo: a small Llama trained with Ulysses 2 × ring 2 on the Python standard library's source.

Run (what `make demo` does):
    accelerate launch --config_file accelerate_configs/cpu_4proc.yaml recipes/demo.py
or  torchrun --nproc-per-node 4 recipes/demo.py
Flexible SP groups (FlexSP / Hydraulis), i.e. `make demo DEMO_ARGS="--flex"`:
    accelerate launch --config_file accelerate_configs/cpu_4proc.yaml recipes/demo.py --flex

Everything is local, nothing comes from a hub: the corpus is the `.py` files of this
Python's own standard library (read with `datasets`), the tokenizer a byte-level BPE
trained on them in seconds with `tokenizers`, the model a small Llama built from a config,
saved with `save_pretrained` and loaded back with `from_pretrained` -- the path a real
checkpoint takes. Global rank 0 builds them once per job in --output-dir, which every node of a
multi-node launch must see (recipes/shared_files.py). Then `hf_longctx.LongContextTrainer` (a `transformers.Trainer`) trains:
step sampler → cost-balanced plan → USP-sharded micro-batches → FSDP2 over all 4 ranks.
The Trainer logs, per step, the loss (the global token mean), tokens/s and the plan's
balance (synced step / ideal); rank 0 prints a summary at the end.

`--flex`: instead of one Ulysses × ring mesh, a group bank (`init_group_bank`: groups of
1, 2 and 4 ranks, the group of 4 split ulysses × ring as above) is the trainer's mesh; each
step's documents are planned with `plan_flexible` under `--max-tokens / 4` tokens per rank
(a group of s ranks holds s × that, so the longest piece is the same as without --flex),
short files train on single ranks without communication and long ones on groups of 2 or 4,
and every step prints its slot layouts (e.g. "[4] [2+1+1]") and the plan's per-rank busy
max/mean. `--flex --unequal-calls` (`make demo DEMO_ARGS="--flex --unequal-calls"`): steps
are planned with `plan_unequal` instead, ranks run different numbers of micro-batches and
FSDP2 keeps the model unsharded for each step (gathered once, gradients synced in each
rank's own last backward).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling modules, also under accelerate launch

from common import add_common_args, check_common_args, patch_kwargs, trainer_kwargs  # noqa: E402
from shared_files import build_once, fill_caches_in_turn  # noqa: E402
from tiny import HEADS, build_model, build_tokenizer, load_corpus, stdlib_files  # noqa: E402

from hf_longctx import LongContextTrainer, init_group_bank, init_sequence_parallel, patch, tokenize_dataset  # noqa: E402
from hf_longctx.training.launch import describe, init_distributed, run_rank  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--files", type=int, default=240, help="stdlib files in the corpus")
    p.add_argument("--max-file-bytes", type=int, default=12000)
    p.add_argument("--tokens-per-step", type=int, default=8192,
                   help="global tokens per optimizer step (the longest default file has 6,290 tokens)")
    p.add_argument("--max-tokens", type=int, default=1536, help="tokens per micro-batch of one SP group")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a collective may block (dead rank)")
    p.add_argument("--output-dir", default="runs/demo")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--flex", action="store_true",
                   help="flexible SP groups: a group bank of sizes 1..world, planned per step (FlexSP / Hydraulis)")
    p.add_argument("--unequal-calls", action="store_true",
                   help="with --flex: ranks run different numbers of micro-batches (model unsharded for each step)")
    p.add_argument("--no-bar", action="store_true", help="plain per-step lines only (CI logs)")
    add_common_args(p, ulysses=2, ring=2, mixed_precision="fp32")  # fp32 on CPU: bf16 matmuls are slow there
    return check_common_args(p, p.parse_args(argv))


def main(argv=None) -> dict:
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainingArguments

    args = parse_args(argv)
    if args.unequal_calls and not args.flex:
        raise SystemExit("--unequal-calls needs --flex (flexible SP groups)")
    torch.set_num_threads(1)  # 4 ranks share the cores: more threads per rank only thrash
    t0 = time.perf_counter()
    device = init_distributed(timeout_s=args.timeout)  # LOCAL_RANK's device + process group with a fault timeout
    main_rank = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # saving / loading a 0.5M-parameter model: bars that say nothing
    if not main_rank:  # one copy of the training bar and of library notices, from rank 0
        hf_logging.set_verbosity_error()
    targs = TrainingArguments(
        output_dir=os.path.join(args.output_dir, "checkpoints"), max_steps=args.steps, learning_rate=args.lr,
        lr_scheduler_type="cosine", warmup_steps=max(1, args.steps // 10), max_grad_norm=1.0, logging_steps=1,
        save_strategy="steps" if args.save_every else "no", save_steps=args.save_every or 500, seed=args.seed,
        report_to=[], disable_tqdm=args.no_bar or not main_rank, use_cpu=device.type == "cpu",
        bf16=args.mixed_precision == "bf16",
    )
    if args.flex:  # ranks_per_node = ulysses: the largest group splits ulysses x ring like the fixed mesh
        mesh = init_group_bank(heads=HEADS, ranks_per_node=args.ulysses)
        caps = dict(max_tokens_per_rank=args.max_tokens // mesh.world_size, unequal_calls=args.unequal_calls)
    else:
        mesh = init_sequence_parallel(ulysses_degree=args.ulysses, ring_degree=args.ring, fpdt_chunks=args.fpdt_chunks)
        caps = dict(max_tokens=args.max_tokens)
    say = print if main_rank else (lambda *a, **k: None)
    say(describe(mesh, device, param_offload=args.param_offload))

    files = stdlib_files(args.files, 200, args.max_file_bytes)
    raw = load_corpus(files)
    tok_path, model_path = os.path.join(args.output_dir, "tokenizer"), os.path.join(args.output_dir, "model")
    if args.tokenizer:  # a given tokenizer instead of the locally trained BPE
        from transformers import AutoTokenizer

        with fill_caches_in_turn():
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)

    def build() -> None:  # global rank 0 only: the BPE (unless given) and the model, saved for every rank
        if not args.tokenizer:
            build_tokenizer(raw["text"], args.vocab, tok_path)
        tok = tokenizer if args.tokenizer else PreTrainedTokenizerFast.from_pretrained(tok_path)
        build_model(tok, model_path, hidden=args.hidden, layers=args.layers, seed=args.seed)

    build_once(args.output_dir, build, what="the demo's tokenizer and model",
               fix="pass an --output-dir on a file system every node mounts")
    if not args.tokenizer:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(tok_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    data = tokenize_dataset(raw, tokenizer, progress=main_rank)
    n_params = sum(p.numel() for p in model.parameters())
    lengths = data["length"]
    say(
        f"corpus: {len(files)} stdlib files, {sum(lengths)} tokens (documents of {min(lengths)}..{max(lengths)} tokens); "
        f"tokenizer: byte-level BPE, {len(tokenizer)} ids; model: Llama {args.layers}x{args.hidden}, {n_params / 1e6:.2f}M params"
    )
    trainer = LongContextTrainer(
        model=patch(model, mesh, **patch_kwargs(args)), args=targs, train_dataset=data, processing_class=tokenizer,
        mesh=mesh, tokens_per_step=args.tokens_per_step, overlong="split", **caps, **trainer_kwargs(args),
    )
    result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    logs = [h for h in trainer.state.log_history if "loss" in h and "tokens_per_s" in h]
    for h in logs:  # one plain line per step (the bar/printer show the same dicts)
        say(f"step {h['step']:4d} | loss {h['loss']:.4f} | lr {h['learning_rate']:.2e} | grad_norm {h['grad_norm']:.3f} | "
            f"{h['tokens_per_s']:.0f} tok/s | plan synced/ideal {h.get('plan_balance', float('nan')):.3f} | "
            f"peak mem {h['peak_mem_gib']:.2f} GiB"
            + (f" | slots {h['plan_layouts']} | busy max/mean {h['plan_busy_max_over_mean']:.3f}" if args.flex else ""))
    tokens = sum(h["step_tokens"] for h in logs)
    summary = {
        "loss_first": logs[0]["loss"], "loss_last": logs[-1]["loss"], "tokens": tokens,
        "train_s": result.metrics["train_runtime"], "wall_s": time.perf_counter() - t0,
        "tokens_per_s": tokens / result.metrics["train_runtime"],
        "balance_mean": sum(h.get("plan_balance", 1.0) for h in logs) / len(logs),
    }
    say(
        f"summary: loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f} over {len(logs)} steps | "
        f"{summary['tokens']:.0f} tokens in {summary['train_s']:.1f}s = {summary['tokens_per_s']:.0f} tok/s | "
        f"plan synced/ideal mean {summary['balance_mean']:.3f} | wall time {summary['wall_s']:.1f}s"
    )
    return summary


if __name__ == "__main__":
    run_rank(main)  # exits without interpreter finalisation (hf_longctx/training/launch.py)
