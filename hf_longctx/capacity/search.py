"""Enumerate and rank (ulysses, ring, fpdt chunks) x memory preset settings; suggest one.

Where it sits: behind `hf-longctx plan` (`cli/capacity.py`) and `suggest()`, its Python twin.
For a model config and a `Cluster` (`capacity/cluster.py`) it lists every mesh the library
can run with each preset of `patch(memory=...)`, estimates per-GPU memory
(`capacity/estimate.py`) and step time (`capacity/step_time.py`: the op inventory of the step
on the cluster's GPU, a roofline with the overlaps the code has; MFU and what binds are its
outputs), and returns the settings
best first: feasible (fitting GPU and host memory), then by throughput; settings within
`TIE_TOLERANCE` (7 %, the cost model's worst measured error) rank by the USP guidance
(`Cluster.follows_usp_guidance`). `suggest()` returns the first as `init_sequence_parallel`
arguments and a preset. Papers: USP §4, FPDT §3-4."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from hf_longctx.config import MEMORY_PRESETS, preset_knobs
from hf_longctx.layout import seq_multiple
from hf_longctx.ops.tiling import default_mlp_chunks
from hf_longctx.ops.ulysses import kv_replication
from hf_longctx.capacity.cluster import Cluster
from hf_longctx.capacity.mixers import mixer_seconds
from hf_longctx.capacity.estimate import (
    DTYPE_BYTES,
    MemoryEstimate,
    ModelDims,
    Setting,
    estimate_memory,
)
from hf_longctx.capacity.fits import inputs_on_device, loss_rows_within
from hf_longctx.capacity.step_time import step_time
from hf_longctx.capacity.suggestion import Suggestion, rollouts_of, task_options, task_trainer


TIE_TOLERANCE = 0.07  # relative step-time difference the estimates cannot resolve (see the module docstring)


@dataclass(frozen=True)
class Candidate:
    setting: Setting
    dp: int
    memory: MemoryEstimate
    step_seconds: float
    tokens_per_second: float  # whole cluster
    reason: str  # "" when feasible, else why not
    time: Any = None  # the step-time model's roofline.Breakdown (MFU, what binds)
    preset: str = "off"  # the patch(memory=...) preset of this setting
    microbatches: int = 1  # per rank and optimizer step
    tied: bool = False  # within TIE_TOLERANCE of the fastest feasible setting's throughput
    gpu_fits: bool = True
    host_fits: bool = True

    @property
    def feasible(self) -> bool:
        return not self.reason

    @property
    def binding(self) -> str:
        """The resource that rules this setting out: "GPU memory", "host memory", "GPU and
        host memory", or "" (it fits, or another reason)."""
        return {(False, True): "GPU memory", (True, False): "host memory",
                (False, False): "GPU and host memory"}.get((self.gpu_fits, self.host_fits), "")


def preset_setting(ulysses: int, ring: int, fpdt_chunks: int, memory: str, dims: ModelDims | None = None) -> Setting:
    """The memory-model `Setting` of a mesh under a `patch(memory=...)` preset (the knobs of
    `config.preset_knobs`; "auto" chunks resolved as `integrations/memory.py` resolves them,
    from the model's sizes when `dims` is given)."""
    knobs = preset_knobs(memory, fpdt_chunks)
    sizes = (dims.intermediate, dims.hidden) if dims is not None else ()
    return Setting(
        ulysses=ulysses, ring=ring, fpdt_chunks=fpdt_chunks, kv_offload=knobs.get("kv_offload", False),
        checkpoint=knobs.get("checkpoint", False),
        mlp_chunks=default_mlp_chunks(fpdt_chunks, *sizes) if knobs.get("mlp_chunks") == "auto" else 1,
        loss_chunks=0 if knobs.get("loss_chunks") == "auto" else 1,
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


PARAM_OFFLOAD = {"auto": (False, True), "yes": (True,), "no": (False,)}
# Sequence-parallel rollouts' (weights, cache) placements, tried in order (sp_generate's "auto" rule):
# the whole model gathered once beside the cache, the weights per unit, the cache on the host too.
ROLLOUT_PLACES = (("gathered", "device"), ("sharded", "device"), ("sharded", "host"))


def enumerate_settings(
    dims: ModelDims, gpus: int, tokens: int, max_fpdt: int = 64, param_offload: str = "no"
) -> list[tuple[Setting, str]]:
    """Every (setting, preset) the library accepts: ulysses × ring dividing `gpus` with
    Ulysses-divisible heads; FPDT chunks (powers of two) only with ring 1; each mesh with
    the four memory presets (K/V offload comes with "high"/"max" exactly when FPDT is on; "max"
    also with keep_attention), and with parameter offload off and/or on (`param_offload`: "no",
    "yes", "auto" = both)."""
    if param_offload not in PARAM_OFFLOAD:
        raise ValueError(f"param_offload must be one of {sorted(PARAM_OFFLOAD)}, got {param_offload!r}")
    out = []
    for sp in _divisors(gpus):
        for ulysses in _divisors(sp):
            try:
                kv_replication(dims.heads, dims.kv_heads, ulysses)
            except ValueError:
                continue
            ring = sp // ulysses
            chunk_options = [1]
            if ring == 1:
                u = 2
                while u <= max_fpdt and u * ulysses <= tokens:
                    chunk_options.append(u)
                    u *= 2
            for u in chunk_options:
                for memory in MEMORY_PRESETS:
                    for off in PARAM_OFFLOAD[param_offload]:
                        s = replace(preset_setting(ulysses, ring, u, memory, dims), param_offload=off)
                        out += [(s, memory)] + ([(replace(s, keep_attention=True), memory)] if memory == "max" else [])
    return out


def rank_settings(
    config: Any, cluster: Cluster, tokens: int, *, seq_len: int | None = None, dtype: str = "bf16",
    optimizer: str = "adamw", unsharded_step: bool = False, grad_sync: str = "step", microbatches: int = 1,
    tokens_per_step: int | None = None, param_offload: str = "auto", vision: Any = None, task: str = "sft",
    rollout_tokens: int | None = None, generation: str = "sp", rollout_cache: str = "auto",
) -> list[Candidate]:
    """Every setting for micro-batches of `tokens` tokens per SP group (documents of
    `seq_len`, default `tokens`) with its estimates, best first: feasible, then highest
    cluster throughput (tokens/s), then lowest peak memory, then fewest FPDT chunks; near
    ties (within TIE_TOLERANCE of the fastest feasible) following the USP guidance first, then
    those that keep no layer input on the GPU (`inputs_on_device`). On a GPU without measured
    kernel fractions (A100) no setting is timed (`time` None, seconds and tokens/s NaN) and
    they come in `untimed_order`.

    Micro-batches per rank and step: `microbatches`, or, with `tokens_per_step` (global),
    ceil(tokens_per_step / (dp × tokens)) for each setting's dp. `param_offload`: "auto"
    (try both), "yes", "no". `vision`: a `capacity/vision.VisionBudget` (images / video per
    document of `seq_len`): the tower's memory and time are charged to every setting. `task`,
    `rollout_tokens`: the training objective and the prompt + completion tokens one generation
    decodes per step here ("grpo" / "rloo" default `seq_len`; 0: their training step alone, which
    `suggest` refuses) -- with `generation` "sp" the SP group's rows, placed as `placed` picks
    (`rollout_cache` "device" / "host" keeps the cache there), "per-rank" one GPU's rows; a pair or a
    group counts all its documents in `tokens`.
    Only settings the task's trainer runs (`suggestion.TASK_TRAINERS`): for "grpo" / "rloo"
    no parameter offload ("auto" tries it off only; "yes" is refused) and gradients
    reduce-scattered in every micro-batch (`grad_sync` "microbatch", as those trainers always
    do); `unsharded_step` (flexible groups) with "sft" only."""
    param_offload, grad_sync = task_options(task, param_offload, grad_sync, unsharded_step)
    seq_len = tokens if seq_len is None else seq_len
    rollout_tokens = rollouts_of(task, rollout_tokens, seq_len)
    _check_sizes(tokens, seq_len, microbatches, tokens_per_step)
    dims = ModelDims.from_config(config)
    usable_gpu, usable_host = (m * (1 - cluster.headroom) for m in (cluster.gpu_memory, cluster.host_memory))
    per_node = min(cluster.gpus, cluster.gpus_per_node)
    places = [p for p in ROLLOUT_PLACES if rollout_cache in ("auto", p[1])] if generation == "sp" else ROLLOUT_PLACES[:1]
    timed = cluster.gpu_spec.timed
    out = []
    for s, preset in enumerate_settings(dims, cluster.gpus, tokens, param_offload=param_offload):
        dp = cluster.gpus // s.sp
        mbs = microbatches if tokens_per_step is None else math.ceil(tokens_per_step / (dp * tokens))

        def memory(s: Setting):
            return placed(lambda w, c: estimate_memory(
                dims, s, world=cluster.gpus, tokens=tokens, dtype=dtype, optimizer=optimizer,
                unsharded_step=unsharded_step, grad_sync=grad_sync, microbatches=mbs, task=task,
                rollout_tokens=rollout_tokens, generation=generation, generation_weights=w, generation_cache=c),
                places, usable_gpu, usable_host / per_node)

        mem = memory(s)
        s, mem = loss_rows_within(s, mem, memory, dims, tokens, usable_gpu)
        if s.checkpoint and not s.keep_attention and mem.host * per_node > usable_host and mem.peak <= usable_gpu:
            s, mem = inputs_on_device(s, mem, memory, dims.layers, usable_gpu, usable_host / per_node)
        time = _timed(config, dims, s, cluster, tokens, seq_len, dtype, mbs, optimizer, grad_sync) if timed else None
        if vision is not None:
            mem = _charge_vision(vision, config, s, cluster, mem, time, tokens / seq_len, dtype, optimizer)
        secs = time.seconds if time is not None else math.nan
        gpu_fits, host_fits = mem.peak <= usable_gpu, mem.host * per_node <= usable_host
        reason = _why_not(s, tokens, mem.peak, mem.host * per_node, usable_gpu, usable_host)
        out.append(Candidate(s, dp, mem, secs, dp * tokens / secs, reason, time, preset, mbs, gpu_fits=gpu_fits,
                             host_fits=host_fits))
    if not timed:
        return sorted(out, key=lambda c: untimed_order(c, cluster, dims))
    # Exact ties (FPDT chunk counts cost the same in this model): the simpler setting first.
    out.sort(key=lambda c: (not c.feasible, -c.tokens_per_second, c.memory.peak, c.setting.fpdt_chunks,
                            c.setting.param_offload))
    if not out or not out[0].feasible:
        return out
    # Near ties: the estimates cannot separate them; the USP guidance decides (stable sort).
    floor = out[0].tokens_per_second * (1 - TIE_TOLERANCE)
    n = next((i for i, c in enumerate(out) if not c.feasible or c.tokens_per_second < floor), len(out))
    # Then the settings that keep no layer input on the GPU (host memory to spare).
    band = sorted((replace(c, tied=n > 1) for c in out[:n]),
                  key=lambda c: (not cluster.follows_usp_guidance(c.setting, dims.heads, dims.kv_heads),
                                 c.setting.inputs_on_device > 0))
    return band + out[n:]


def _timed(config: Any, dims: ModelDims, s: Setting, cluster: Cluster, tokens: int, seq_len: int, dtype: str,
           mbs: int, optimizer: str, grad_sync: str) -> Any:
    """The step-time model's `StepTime` of one setting, the hybrid's linear mixers included."""
    time = step_time(dims, s, cluster, tokens, seq_len=seq_len, dtype=dtype, microbatches=mbs, optimizer=optimizer,
                     grad_sync=grad_sync)
    mixers = mixer_seconds(config, s, cluster, tokens, dtype)
    if mixers:
        time.other["linear mixers"] = mixers
    return time


def placed(estimate: Any, places: list, gpu: float, host: float) -> Any:
    """The estimate (`estimate(weights, cache)`) of the first rollout placement that fits `gpu` device
    bytes and `host` host bytes per GPU, as sp_generate's weights="auto", cache="auto" picks; else the last."""
    est = [estimate(w, c) for w, c in places]
    return next((m for m in est if m.peak <= gpu and m.host <= host), est[-1])


def _why_not(s: Setting, tokens: int, gpu: float, host: float, usable_gpu: float, usable_host: float) -> str:
    """Why setting `s` cannot run (empty when it can): the length its degrees cannot split, or the
    GPU and host bytes (per node) past what is usable."""
    multiple = seq_multiple(s.ring, s.ulysses, s.fpdt_chunks)
    if tokens % multiple:
        return f"seq-len {tokens} is not a multiple of {multiple}"
    reasons = [] if gpu <= usable_gpu else [f"GPU {gpu / 2**30:.1f} > {usable_gpu / 2**30:.1f} GiB"]
    if host > usable_host:
        reasons.append(f"host {host / 2**30:.1f} > {usable_host / 2**30:.1f} GiB")
    return "; ".join(reasons)


def untimed_order(c: Candidate, cluster: Cluster, dims: ModelDims) -> tuple:
    """The order of settings on a GPU without a step time (`capacity/gpus.GPU.timed`): the ones
    that fit, then the least recomputation and host traffic (a lighter memory preset, no
    parameter offload, fewer FPDT chunks, keep_attention), the USP guidance, the lowest peak.
    Not a time: which of them is fastest on that card is not known."""
    s = c.setting
    return (not c.feasible, MEMORY_PRESETS.index(c.preset), s.param_offload, s.fpdt_chunks, not s.keep_attention,
            not cluster.follows_usp_guidance(s, dims.heads, dims.kv_heads), c.memory.peak)


def _check_sizes(tokens: int, seq_len: int, microbatches: int, tokens_per_step: int | None) -> None:
    """`rank_settings`' sizes, each refused with its value."""
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be an int >= 1, got {microbatches!r}")
    if tokens_per_step is not None and tokens_per_step < tokens:
        raise ValueError(f"tokens_per_step ({tokens_per_step}) must be >= the micro-batch tokens ({tokens})")
    if not 1 <= seq_len <= tokens:
        raise ValueError(f"need 1 <= seq_len <= micro-batch tokens, got seq_len {seq_len}, tokens {tokens}")


def suggest(
    config: Any, cluster: Cluster, tokens: int, *, seq_len: int | None = None, dtype: str = "bf16",
    optimizer: str = "adamw", unsharded_step: bool = False, grad_sync: str = "step", microbatches: int = 1,
    tokens_per_step: int | None = None, param_offload: str = "auto", task: str = "sft",
    rollout_tokens: int | None = None, generation: str = "sp",
) -> Suggestion:
    """The fastest setting by the step-time estimate among those whose estimated peak fits
    (the first row of `hf-longctx plan` with the same arguments; near ties broken by the USP
    guidance), as code and flags for `task`'s trainer and recipes. `rollout_tokens`: as
    `rank_settings`, but 0 is refused for "grpo" / "rloo": their trainers generate on the
    training GPUs always, so a suggestion without the rollouts could not run. "dpo" is the held
    reference's best; `hf-longctx plan --task dpo` then picks, and suggests, the precomputed
    reference's (`task="dpo-precomputed"` here). Raises ValueError naming the lowest estimated
    peak when nothing fits."""
    if rollout_tokens is not None and rollout_tokens < 1 and task in ("grpo", "rloo"):
        raise ValueError(f"rollout_tokens={rollout_tokens}: {task_trainer(task).name} generates its rollouts on the "
                         "training GPUs, always (use_vllm is refused), so a setting without them cannot run; pass the "
                         "prompt + completion tokens one generation decodes per step, or None (seq_len)")
    ranked = rank_settings(config, cluster, tokens, seq_len=seq_len, dtype=dtype, optimizer=optimizer,
                           unsharded_step=unsharded_step, grad_sync=grad_sync, microbatches=microbatches,
                           tokens_per_step=tokens_per_step, param_offload=param_offload, task=task,
                           rollout_tokens=rollout_tokens, generation=generation)
    if not ranked[0].feasible:
        low = min(ranked, key=lambda c: c.memory.peak)
        raise ValueError(
            f"no setting fits: the lowest estimated peak is {low.memory.peak / 2**30:.1f} GiB per GPU "
            f"({low.setting}, memory={low.preset!r}: {low.reason})"
        )
    return Suggestion.of(ranked[0], tokens, grad_sync=task_options(task, param_offload, grad_sync, unsharded_step)[1],
                         dtype=dtype, task=task)


def _charge_vision(vision: Any, config: Any, s: Setting, cluster: Cluster, mem: Any, time: Any, samples: float,
                   dtype: str, optimizer: str) -> Any:
    """The vision tower's memory (returned) and seconds (into `time.other`, when the GPU is
    timed) for a setting, with `samples` images / videos per micro-batch."""
    from hf_longctx.capacity.vision import vision_cost

    dt, gpu = DTYPE_BYTES[dtype], cluster.gpu_spec
    if time is not None:
        time.other["vision tower"] = vision.seconds(vision_cost(config), sp=s.sp, samples=samples,
                                                    rate=gpu.gemm * gpu.bf16_flops, bandwidth=cluster.bandwidth(s.sp),
                                                    dt=dt)
    return vision.charge(mem, sp=s.sp, world=cluster.gpus, samples=samples, dt=dt, optimizer=optimizer)
