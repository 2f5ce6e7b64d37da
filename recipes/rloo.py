"""RLOO (REINFORCE leave-one-out, Ahmadian et al. 2024) with TRL's RLOOTrainer, exact under sequence parallelism.

Run on CPU (gloo) with a tiny Llama built here, locally made prompts and common.py's format reward:
    accelerate launch --config_file accelerate_configs/cpu_4proc.yaml recipes/rloo.py --ulysses 2
    accelerate launch --multi_gpu --num_processes 2 recipes/rloo.py --ulysses 2 --steps 2 --beta 0
or a real model and a prompt dataset (a `prompt` column, text or conversational):
    accelerate launch --config_file accelerate_configs/gpu_1node_8.yaml recipes/rloo.py --model PATH \
        --dataset json --data-files prompts.jsonl --ulysses 8 --num-generations 8 --max-completion-length 32768 \
        --max-tokens 65536 --steps 500 --mixed-precision bf16 --output-dir runs/rloo --export

Where it sits: the user's path, a TRL RLOOTrainer script plus `mesh=`; the same shared flags and
the same run as recipes/grpo.py (`common.train_rollouts`: the tiny Llama and made-up prompts
without --model / --dataset, the format reward, per-rank step logs in
OUTPUT_DIR/steps.rank<R>.jsonl). `hf_longctx.LongRLOOTrainer` trains with TRL's own pieces -- its
sampler, generation (sequence-parallel by default; --generation per-rank: TRL's generate on
gathered, unpatched weights), the reward, the KL penalty in the reward
(--beta, TRL's default 0.05: the policy's and the reference's per-token log-probs computed on
the SP shards), leave-one-out advantages (--normalize-advantages: over the whole generation
batch) and logging -- and the training step under SP: the SP group trains on the union of its
ranks' rows as one packed, sharded row (--max-tokens N: packed micro-batches of <= N tokens, for
the scoring forwards and the training step), TRL's clipped sequence-ratio loss with each
completion's log-prob summed across its SP shards, FSDP2 summing the gradients over DP x SP.
Every step prints TRL's metrics (loss, grad_norm, reward, reward_std, kl, entropy, clip_ratio/*,
completions/*) as global values. --memory and the other `patch` flags are honoured, and
--sync-each-microbatch and --param-offload refused, as in grpo.py. --save-every N writes sharded checkpoint-N/ folders, --resume continues from the
newest one (same --model: the reference is rebuilt from it); --export saves the trained model.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling module, also under accelerate launch

from common import parse_rollout_args, train_rollouts  # noqa: E402

from hf_longctx import LongRLOOTrainer  # noqa: E402
from hf_longctx.training.launch import run_rank  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    normalize = dict(action="store_true", help="RLOOConfig.normalize_advantages: advantages to mean 0, std 1 over the "
                                               "generation batch")
    return parse_rollout_args(__doc__, argv, beta=0.05, output_dir="runs/rloo", trainer="LongRLOOTrainer",
                              own={"--normalize-advantages": normalize})


def main(argv=None) -> None:
    args = parse_args(argv)
    train_rollouts(args, "RLOOConfig", LongRLOOTrainer, normalize_advantages=args.normalize_advantages)


if __name__ == "__main__":
    run_rank(main)  # exits without interpreter finalisation (hf_longctx/training/launch.py)
