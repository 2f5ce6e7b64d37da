"""The throughput table of the step-time model: Llama-3.1-8B widths on 1 and 8 H100s, per preset.

Where it sits: `benchmarks/gpu_model.py --table` prints it (the README's throughput table).
For each GPU count and length it ranks every setting (`capacity/search.rank_settings`: memory
estimate and step-time model) and shows, per memory preset, the fastest setting of that preset
that fits (or, where none does, says so and names the planner's best), with modelled tokens/s
and MFU per GPU and what binds; then the published anchors and the targets (printed, never
asserted)."""

from __future__ import annotations

from pathlib import Path

from hf_longctx.capacity.cluster import Cluster
from hf_longctx.capacity.search import rank_settings
from hf_longctx.cli.inputs import load_config

CONFIG = Path(__file__).resolve().parents[1] / "tests" / "data" / "llama-3.1-8b-config.json"
G = 2**30
LENGTHS = (1 << 15, 1 << 17, 1 << 20)
PRESETS = ("off", "balanced", "high", "max")
TRL_SECONDS = 380.0  # TRL context parallelism, Qwen3-8B, 1M tokens per step on 8 x H100 (about 34 % MFU with attention)
FPDT_MFU = 0.55  # FPDT paper: over 55 % MFU


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
    print(f"| 8 | 1,048,576 | TRL (Qwen3-8B, published) | context parallelism | 1,048,576 | {TRL_SECONDS:.0f} | | "
          f"{trl:,.0f} | ~34 % | |")
    print(f"| | | FPDT (published) | | | | | | > {100 * FPDT_MFU:.0f} % | |")
    _targets(out)
    return out


def _targets(out: dict) -> None:
    mx = out.get((1, 1 << 17, "max"))
    best = out.get((8, 1 << 20, "best"))
    print("\nTargets (printed, not asserted):")
    if mx is not None:
        t = mx.time
        mfu = t.model_flops / ((t.seconds - t.other.get("CPU optimizer", 0.0)) * t.gpu.bf16_flops)
        print(f"- memory='max' at 128K on one H100, 8B widths: modelled MFU {100 * mfu:.1f} % of forward + backward "
              f"({100 * t.mfu:.1f} % with the CPU optimizer step of parameter offload, which 8B on one 80 GB GPU needs) "
              f"(target >= 45 %): {'met' if mfu >= 0.45 else 'NOT met'}; binds {t.binds}; " + _why(mx))
    if best is not None:
        per_million = best.step_seconds / best.dp  # a step of dp x 1M tokens: seconds per 1M tokens, as TRL's
        ok = per_million <= 266
        print(f"- the planner's best for 1M tokens on 8 H100s: {best.preset}, {_setting(best)}, {per_million:.0f} s "
              f"per 1M tokens ({best.step_seconds:.0f} s per step of {best.dp} x 1M) (target <= 266 s = 0.7 x TRL's "
              f"380 s): {'met' if ok else 'NOT met'}; binds {best.time.binds}; " + _why(best))


def _why(c) -> str:
    """Where the seconds go, largest first, and what a faster attention kernel would give."""
    t = c.time
    terms = {"flash-attn kernels": t.attention, "GEMMs": t.flops - t.attention, "HBM (elementwise)": t.hbm,
             "launches": t.launches, **{f"link {k}": v for k, v in t.links.items()}, **t.other}
    spent = ", ".join(f"{k} {v:.1f} s" for k, v in sorted(terms.items(), key=lambda kv: -kv[1]) if v > 0.05 * t.seconds)
    g = t.gpu
    now = t.attention_flops / t.attention / g.bf16_flops if t.attention else 0.0
    faster = t.seconds - t.attention + t.attention_flops / (g.gemm * g.bf16_flops)
    optim = t.other.get("CPU optimizer", 0.0)
    return (f"{spent}. With attention kernels as efficient as the GEMMs ({g.gemm:.0%} of peak instead of "
            f"{now:.0%}) the model gives {faster:.0f} s, MFU {100 * t.model_flops / ((faster - optim) * g.bf16_flops):.0f} % "
            "(fwd+bwd)")
