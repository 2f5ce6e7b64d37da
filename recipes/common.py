"""The options every training recipe shares, and where each one goes.

Where it sits: before the training data flow. `recipes/pretrain.py` (and `lora.py` on top
of it), `recipes/sft.py` and `recipes/demo.py` add these to their own parsers, so one
setting printed by `hf-longctx plan` ("as recipe flags") pastes into any of them:

  --ulysses / --ring / --fpdt-chunks  -> init_sequence_parallel(...)          (USP §4, FPDT §3)
  --memory off|balanced|max           -> patch(model, mesh, memory=...)       (FPDT §4 presets)
  --kv-offload                         -> patch(kv_offload=True)  (expert knob; not with --memory)
  --sync-each-microbatch               -> LongContextTrainer(sync_each_microbatch=True)
  --param-offload                      -> LongContextTrainer(param_offload=True) (FSDP2 CPUOffloadPolicy)
  --mixed-precision bf16|fp32          -> TrainingArguments(bf16=...) -> fsdp_plan(mixed_precision=...)
  --resume                             -> trainer.train(resume_from_checkpoint=True)
  --tokenizer                          -> AutoTokenizer.from_pretrained (default: --model)
"""

from __future__ import annotations

import argparse

from hf_longctx.config import MEMORY_PRESETS


def add_common_args(p: argparse.ArgumentParser, *, ulysses: int = 1, ring: int = 1,
                    mixed_precision: str = "bf16") -> argparse.ArgumentParser:
    """Add the shared options to `p` (defaults per recipe: the demo runs Ulysses 2 × ring 2 in fp32)."""
    g = p.add_argument_group("parallelism and memory (shared by every recipe; `hf-longctx plan` prints them)")
    g.add_argument("--tokenizer", default=None, help="from_pretrained path or hub id; default: --model")
    g.add_argument("--ulysses", type=int, default=ulysses, help="Ulysses degree of each SP group")
    g.add_argument("--ring", type=int, default=ring, help="ring degree of each SP group")
    g.add_argument("--fpdt-chunks", type=int, default=1, help="FPDT chunks per local sequence (needs --ring 1)")
    g.add_argument("--memory", choices=MEMORY_PRESETS, default=None,
                   help="patch(memory=...) preset: chunked MLP/loss ('balanced'), plus offloaded checkpointing and "
                        "K/V offload with FPDT ('max'); default: none")
    g.add_argument("--kv-offload", action="store_true", help="FPDT: offload K/V chunks to host (not with --memory)")
    g.add_argument("--sync-each-microbatch", action="store_true",
                   help="reduce-scatter gradients in every micro-batch (sharded accumulation, 4 B/param less memory)")
    g.add_argument("--param-offload", action="store_true",
                   help="FSDP2 CPUOffloadPolicy: parameter/gradient shards and optimizer states in host memory")
    g.add_argument("--mixed-precision", choices=("bf16", "fp32"), default=mixed_precision,
                   help="bf16 compute with fp32 master weights, or fp32 throughout")
    g.add_argument("--resume", action="store_true", help="continue from the newest checkpoint-N in the output dir")
    return p


def check_common_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Refuse combinations the library would refuse later on every rank (before any process group)."""
    for name in ("ulysses", "ring", "fpdt_chunks"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.memory is not None and args.kv_offload:
        p.error(f"--memory {args.memory} and --kv-offload together: the preset sets K/V offload ('max' with "
                "--fpdt-chunks > 1 offloads); pass one of them")
    return args


def patch_kwargs(args: argparse.Namespace) -> dict:
    """The keyword arguments of `patch(model, mesh, ...)`."""
    return {"memory": args.memory} if args.memory is not None else ({"kv_offload": True} if args.kv_offload else {})


def trainer_kwargs(args: argparse.Namespace) -> dict:
    """The keyword arguments of `LongContextTrainer` / `LongContextTrainerMixin` these options set."""
    return {"sync_each_microbatch": args.sync_each_microbatch, "param_offload": args.param_offload}


def refuse_flags(p: argparse.ArgumentParser, args: argparse.Namespace, unsupported: dict[str, str]) -> None:
    """A recipe that does not honour some shared flags refuses them when set (never drops one
    silently): `unsupported` maps the option name to what to do instead."""
    for name, instead in unsupported.items():
        if getattr(args, name) != p.get_default(name):
            p.error(f"--{name.replace('_', '-')} is not supported by this recipe; do instead: {instead}")
