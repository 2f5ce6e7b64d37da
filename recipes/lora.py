"""LoRA fine-tuning on long documents: `recipes/pretrain.py` plus a PEFT adapter.

Run, e.g. a single GPU with FPDT chunking and host offload:
    accelerate launch --config_file accelerate_configs/gpu_1_fpdt.yaml recipes/lora.py \
        --model Qwen/Qwen2.5-0.5B --dataset json --data-files long.jsonl --fpdt-chunks 8 --kv-offload \
        --tokens-per-step 262144 --max-tokens 262144 --steps 200 --lr 2e-4 --output-dir runs/lora --export

The adapter wraps the model before `patch()` (which accepts a PEFT model) and before the
FSDP2 plan: FSDP2 shards frozen base weights and trainable adapter weights alike, and only
the adapter parameters reach the optimizer. `--export` writes the adapter with
`save_pretrained` (load it back with `PeftModel.from_pretrained`).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling recipe, also under accelerate launch

from pretrain import build_parser, parse_args, run  # noqa: E402

from hf_longctx.training.launch import run_rank  # noqa: E402


def main() -> None:
    parser = build_parser(__doc__.split("\n")[0])
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--lora-alpha", type=int, default=32)
    parser.add_argument("--lora-targets", nargs="*", default=None, help="module names; default: PEFT's per-model list")
    parser.set_defaults(lr=2e-4, weight_decay=0.0)
    args = parse_args(parser)

    def wrap(model):
        from peft import LoraConfig, get_peft_model

        # lora_dropout 0: dropout masks differ per SP shard of one sequence, and the
        # gradients would no longer equal the single-device ones.
        cfg = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0, target_modules=args.lora_targets,
                         task_type="CAUSAL_LM")
        return get_peft_model(model, cfg)

    run(args, wrap)


if __name__ == "__main__":
    run_rank(main)  # exits without interpreter finalisation (hf_longctx/training/launch.py)
