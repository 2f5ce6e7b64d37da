"""The throughput table of the step-time model: Llama-3.1-8B widths on 1 and 8 H100s, per preset.

Where it sits: `benchmarks/gpu_model.py --table` prints it (the README's throughput table).
For each GPU count and length it ranks every setting (`capacity/search.rank_settings`: memory
estimate and step-time model) and shows, per memory preset, the fastest setting of that preset
that fits (or, where none does, says so and names the planner's best), with modelled tokens/s
and MFU per GPU (this project's strict count, capacity/mfu.py) and what binds; then the
published anchors (TRL's seconds as MFU by the three counts) and the targets
(`gpu_targets.py`: printed, never asserted)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.gpu_targets import TRL_SECONDS, print_targets
from hf_longctx.capacity.cluster import Cluster
from hf_longctx.capacity.search import rank_settings
from hf_longctx.cli.inputs import load_config

CONFIG = Path(__file__).resolve().parents[1] / "tests" / "data" / "llama-3.1-8b-config.json"
G = 2**30
LENGTHS = (1 << 15, 1 << 17, 1 << 20)
PRESETS = ("off", "balanced", "high", "max")
FPDT_MFU = 0.55  # FPDT paper: over 55 % MFU, under its own count
# Qwen3-8B's widths (TRL's measured 1M-token step), for its MFU computed here by the three counts.
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)


def _setting(c) -> str:
    s = c.setting
    text = f"U{s.ulysses}xR{s.ring}" + (f", FPDT u={s.fpdt_chunks}" if s.fpdt_chunks > 1 else "")
    text += ", param offload" if s.param_offload else ""
    text += ", keep_attention" if s.keep_attention else ""
    return text + (f", inputs on GPU {s.inputs_on_device}" if s.inputs_on_device else "")


def rows(config, gpus: int, tokens: int) -> list[tuple]:
    """(preset, candidate or None, planner's best) per preset."""
    cluster = Cluster(gpus=gpus, gpu_memory=80 * G, host_memory=2048 * G, gpu="h100")
    ranked = rank_settings(config, cluster, tokens)
    best = next((c for c in ranked if c.feasible), None)
    return [(p, next((c for c in ranked if c.feasible and c.preset == p), None), best) for p in PRESETS]


def table() -> dict:
    """Print the table; return {(gpus, tokens, preset): candidate} for the targets."""
    config = load_config(str(CONFIG))
    print("\nModelled throughput, Llama-3.1-8B widths (tests/data/llama-3.1-8b-config.json), H100 SXM 80 GB, host 2 TiB "
          "per node, one document per micro-batch, forward + backward (step-time model, capacity/step_time.py)")
    print("| GPUs | tokens | memory | setting (fastest of the preset that fits) | tokens per step | fwd+bwd s | "
          "CPU optimizer s | tok/s per GPU | MFU (fwd+bwd) | binds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    out = {}
    for gpus in (1, 8):
        for tokens in LENGTHS:
            for preset, c, best in rows(config, gpus, tokens):
                out[gpus, tokens, preset] = c
                if c is None:
                    where = f"planner's best: {best.preset}, {_setting(best)}" if best else "nothing fits"
                    print(f"| {gpus} | {tokens:,} | {preset} | does not fit ({where}) | | | | | | |")
                    continue
                t = c.time
                optim = t.other.get("CPU optimizer", 0.0)
                mfu = t.model_flops / ((t.seconds - optim) * t.gpu.bf16_flops)
                print(f"| {gpus} | {tokens:,} | {preset} | {_setting(c)} | {c.dp * tokens:,} | {t.seconds - optim:.2f} | "
                      f"{optim:.1f} | {c.tokens_per_second / gpus:,.0f} | {100 * mfu:.1f} % | {t.binds} |")
            out[gpus, tokens, "best"] = rows(config, gpus, tokens)[0][2]
    trl = (1 << 20) / TRL_SECONDS / 8
    print(f"| 8 | 1,048,576 | TRL (Qwen3-8B, measured by TRL) | context parallelism | 1,048,576 | {TRL_SECONDS:.0f} | | "
          f"{trl:,.0f} | {_trl_mfu()} | |")
    print(f"| | | FPDT (published) | | | | | | > {100 * FPDT_MFU:.0f} % (FPDT's own count) | |")
    print("MFU (fwd+bwd): this project's strict count (capacity/mfu.py: the causal half of attention, recompute not "
          "counted); TRL's row by the three counts from its published 380 s (TRL publishes seconds, not an MFU)")
    print_targets()
    return out


def _trl_mfu() -> str:
    """TRL's 380 s per 1M-token step of Qwen3-8B on 8 H100s as MFU by the three counts
    (gradient checkpointing on, as its long-context guide runs it)."""
    from transformers import LlamaConfig

    from hf_longctx.capacity.mfu import MEGATRON_DEEPSPEED, STRICT, TORCHTITAN, by_convention
    from hf_longctx.data.model_dims import ModelDims

    f = by_convention(ModelDims.from_config(LlamaConfig(**QWEN3_8B)), 1 << 20, checkpointed=True)
    pct = {k: 100 * v / (TRL_SECONDS * 8 * 989e12) for k, v in f.items()}
    return (f"{pct[STRICT]:.1f} % strict ({pct[TORCHTITAN]:.1f} % torchtitan's, {pct[MEGATRON_DEEPSPEED]:.1f} % "
            "Megatron-DeepSpeed's)")
