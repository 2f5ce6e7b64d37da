"""The two modelled throughput targets of Llama-3.1-8B, printed (never asserted).

Where it sits: `benchmarks/gpu_model.py --table` prints them after the throughput table; the
planner (`capacity/search.rank_settings`) picks each setting. The targets: MFU >= 45 % (this
project's strict count, forward + backward) for `memory="max"` with `keep_attention` at 128K
tokens on one H100; <= 266 s per step for one 1M-token sequence on 8 H100s (0.7 x the 380 s
TRL measured for Qwen3-8B). Each is modelled twice: with the flash-attn fractions measured here
(torch's FlashAttention-2 port, capacity/gpus.py) and with FlashAttention-3-class fractions
ASSUMED from the literature (not measured here: `FA3_ASSUMED`), every other constant the same.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from hf_longctx.capacity.cluster import Cluster
from hf_longctx.capacity.mfu import MEGATRON_DEEPSPEED, STRICT, TORCHTITAN, by_convention
from hf_longctx.capacity.search import rank_settings
from hf_longctx.cli.inputs import load_config
from hf_longctx.data.model_dims import ModelDims

CONFIG = Path(__file__).resolve().parents[1] / "tests" / "data" / "llama-3.1-8b-config.json"
G = 2**30
TRL_SECONDS = 380.0  # TRL 1.13 release notes: Qwen3-8B, 1,048,576 tokens per step on 8 x H100, 380 s/step
MFU_TARGET, SECONDS_TARGET = 0.45, 0.7 * TRL_SECONDS
# FlashAttention-3 (Shah et al. 2024) on H100, bf16, head dim 128: forward up to 740 TFLOP/s (0.75 of
# 989); backward 1.5-1.75x FlashAttention-2's, taken as 0.55. Assumed, not measured here.
FA3_ASSUMED = ((128, 0.75, 0.55),)


@dataclass(frozen=True)
class AssumedAttention(Cluster):
    """A cluster whose GPU's flash-attn fractions are replaced by `attention` (assumed ones)."""

    attention: tuple = FA3_ASSUMED

    @property
    def gpu_spec(self):
        spec = super().gpu_spec
        return replace(spec, attention=self.attention,
                       fractions=spec.fractions + "; flash-attn: FlashAttention-3-class, assumed from the literature")


def kernels() -> dict:
    return {"FA2 (measured: torch's port, capacity/gpus.py)": Cluster,
            "FA3-class (ASSUMED from the literature, not measured here)": AssumedAttention}


def _fastest(config, cluster, tokens: int, keep) -> object:
    """The fastest feasible setting that `keep` accepts."""
    return next((c for c in rank_settings(config, cluster, tokens) if c.feasible and keep(c)), None)


def _mfus(dims, c, tokens: int, seconds: float) -> dict:
    f = by_convention(dims, tokens, checkpointed=bool(c.setting.checkpoint))
    return {k: v / (c.setting.sp * seconds * c.time.gpu.bf16_flops) for k, v in f.items()}


def targets() -> list[dict]:
    """One dict per (target, kernels): the setting, seconds, MFU by the three counts, what
    binds, the target and whether the model meets it."""
    config = load_config(str(CONFIG))
    dims = ModelDims.from_config(config)
    out = []
    for name, make in kernels().items():
        one = make(gpus=1, gpu_memory=80 * G, host_memory=2048 * G, gpu="h100")
        c = _fastest(config, one, 1 << 17, lambda c: c.preset == "max" and c.setting.keep_attention)
        optim = c.time.other.get("CPU optimizer", 0.0)
        mfu = _mfus(dims, c, 1 << 17, c.step_seconds - optim)
        out.append(dict(target="memory='max' + keep_attention, 128K tokens, 1 H100", kernels=name, candidate=c,
                        seconds=c.step_seconds - optim, optimizer=optim, mfu=mfu, with_optimizer=c.time.mfu,
                        goal=f"MFU >= {MFU_TARGET:.0%} (strict, fwd+bwd)", met=mfu[STRICT] >= MFU_TARGET))
        eight = make(gpus=8, gpu_memory=80 * G, host_memory=2048 * G, gpu="h100")
        c = _fastest(config, eight, 1 << 20, lambda c: c.setting.sp == 8)  # one sequence per step, as TRL's
        out.append(dict(target="one 1M-token sequence per step, 8 H100s", kernels=name, candidate=c,
                        seconds=c.step_seconds, optimizer=c.time.other.get("CPU optimizer", 0.0),
                        mfu=_mfus(dims, c, 1 << 20, c.step_seconds), with_optimizer=c.time.mfu,
                        goal=f"<= {SECONDS_TARGET:.0f} s per step (0.7 x TRL's {TRL_SECONDS:.0f} s)",
                        met=c.step_seconds <= SECONDS_TARGET))
    return sorted(out, key=lambda r: r["target"].startswith("one"))  # each target's two rows together


def describe(c) -> str:
    s = c.setting
    text = f"{c.preset}, U{s.ulysses}xR{s.ring}" + (f", FPDT u={s.fpdt_chunks}" if s.fpdt_chunks > 1 else "")
    return text + (", param offload" if s.param_offload else "") + (", keep_attention" if s.keep_attention else "")


def print_targets(rows: list[dict] | None = None) -> list[dict]:
    """Print `targets()` (or `rows`, already computed) as a table; return them."""
    rows = targets() if rows is None else rows
    print("\nTargets, Llama-3.1-8B (32 layers; tests/data/llama-3.1-8b-config.json), H100 SXM 80 GB, host 2 TiB per "
          "node (modelled, printed, not asserted). MFU: this project's strict count (capacity/mfu.py), torchtitan's "
          "and Megatron-DeepSpeed's beside it; 'FA3-class' replaces only the flash-attn fractions, by ASSUMED ones")
    print("| target | flash-attn fractions | setting | s per step (fwd+bwd) | CPU optimizer s | MFU strict / "
          "torchtitan / Megatron-DS (fwd+bwd) | strict MFU with the optimizer step | binds | goal | met |")
    print("|" + "---|" * 10)
    for r in rows:
        m, c = r["mfu"], r["candidate"]
        print(f"| {r['target']} | {r['kernels']} | {describe(c)} | {r['seconds']:.1f} | {r['optimizer']:.1f} | "
              f"{100 * m[STRICT]:.1f} / {100 * m[TORCHTITAN]:.1f} / {100 * m[MEGATRON_DEEPSPEED]:.1f} % | "
              f"{100 * r['with_optimizer']:.1f} % | {c.time.binds} | {r['goal']} | {'yes' if r['met'] else 'no'} |")
    print("(Megatron-DeepSpeed's count credits the whole attention square and, under checkpointing, a recompute "
          "that keep_attention does not run: above 100 % it is not a utilisation of this code.)")
    return rows
