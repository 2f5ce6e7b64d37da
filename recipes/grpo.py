"""GRPO (DeepSeekMath §4.1) on long completions with TRL's GRPOTrainer, exact under sequence parallelism.

Run on CPU (gloo) with a tiny Llama built here, locally made prompts and common.py's format reward:
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
sampler (each process draws --per-device-train-batch-size rows of the step), generation
(sequence-parallel: the SP group decodes its ranks' rows together, the KV cache sharded over it;
--generation per-rank: TRL's generate on gathered, unpatched weights), the reward
function of recipes/common.py (`format_scores`), group advantages and logging -- and the training step under SP: the SP group
trains on the union of its ranks' rows as one packed, sharded row (--max-tokens N: several
packed micro-batches of <= N tokens with gradient accumulation, the same result), with GRPOConfig's loss
(--loss-type grpo | dr_grpo | dapo; --beta > 0: KL to TRL's reference, the initial model
loaded again, patched and sharded like the policy), FSDP2 summing the gradients over DP x SP.
Every step prints TRL's metrics (loss, grad_norm, reward, reward_std, kl, entropy,
clip_ratio/*, completions/*) as global values; every rank writes them to
OUTPUT_DIR/steps.rank<R>.jsonl. --memory, --inputs-on-device, --kv-offload (with --fpdt-chunks)
and --mixers go to `patch` (policy and reference; --generation per-rank takes the patch off for generation and puts the
same options back). Refused (LongGRPOTrainer has no such option): --sync-each-microbatch (it
reduce-scatters in every micro-batch's backward always) and --param-offload (its FSDP2 shards
and optimizer states stay on the device). --save-every N
writes sharded checkpoint-N/ folders (policy and optimizer shards of every rank, scheduler, RNG; the
frozen reference is rebuilt from --model, so resume with the same --model); --resume continues from
the newest one exactly as the uninterrupted run would; --export saves the trained model.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling module, also under accelerate launch

from common import parse_rollout_args, train_rollouts  # noqa: E402

from hf_longctx import LongGRPOTrainer  # noqa: E402
from hf_longctx.training.launch import run_rank  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    loss_type = dict(default="dapo", help="GRPOConfig.loss_type (grpo, dr_grpo, dapo)")
    return parse_rollout_args(__doc__, argv, beta=0.0, output_dir="runs/grpo", trainer="LongGRPOTrainer",
                              own={"--loss-type": loss_type})


def main(argv=None) -> None:
    args = parse_args(argv)
    train_rollouts(args, "GRPOConfig", LongGRPOTrainer, loss_type=args.loss_type)


if __name__ == "__main__":
    run_rank(main)  # exits without interpreter finalisation (hf_longctx/training/launch.py)
