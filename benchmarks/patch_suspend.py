"""What the per-rank rollout path pays per generation round to take the SP patch off and put it
back: `model_patch.suspended` (the same PatchState re-installed, nothing resolved, validated or
probed) beside unpatch + `patch_with` of the same options (a new patch: the model checked and
the dry run run again), side by side in one run on a world-1 mesh.

Where it sits: beside `benchmarks/decode_cost.py`; what it times is
`training/grpo/generate.unpatched_for_generation`'s patch work (the FSDP2 gather around it is
the same either way and not timed). A tiny Llama built from a config, saved and loaded back.

    PYTHONPATH=. python benchmarks/patch_suspend.py [--layers 2] [--rounds 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_longctx import init_sequence_parallel  # noqa: E402
from hf_longctx.integrations import model_patch  # noqa: E402


def _model(layers: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as path:
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    model, mesh = _model(args.layers), init_sequence_parallel()
    print(f"tiny Llama, {args.layers} layers, world-1 mesh, {args.rounds} rounds per cell, torch {torch.__version__}")
    print(f"{'memory':>8} | {'unpatch + patch_with (ms)':>26} | {'suspended (ms)':>15} | ratio")
    for memory in ("off", "balanced", "max"):
        model_patch.patch(model, mesh, memory=memory)

        def repatch():
            state = model_patch.patch_state(model)
            model_patch.unpatch(model)
            model_patch.patch_with(model, state.bank, state.options, mixers=state.mixers_option)

        def suspend():
            with model_patch.suspended(model):
                pass

        times = {}
        for f in (repatch, suspend, repatch, suspend):  # interleaved: the two measured side by side
            t = time.perf_counter()
            for _ in range(args.rounds):
                f()
            times.setdefault(f.__name__, []).append((time.perf_counter() - t) / args.rounds * 1e3)
        a, b = min(times["repatch"]), min(times["suspend"])
        print(f"{memory:>8} | {a:26.2f} | {b:15.2f} | {a / b:5.1f}x")
        model_patch.unpatch(model)


if __name__ == "__main__":
    main()
