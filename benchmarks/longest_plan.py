"""The longest context `hf-longctx plan` finds per cluster, beside the published figures.

Where it sits: outside the library; drives `capacity/search.rank_settings` (the planner's
memory model, `capacity/budget.py`) for the repository's Llama-3.1-8B and Llama-3-70B configs,
bf16, AdamW, one micro-batch per step, 10 % of GPU and host memory kept free. For each
cluster it doubles the length (multiples of 8K tokens per GPU) until no setting fits, then
bisects; the row is the longest length with a feasible setting and that setting (the
planner's first choice there). "binds" names the resource closest to its limit. These are
estimates of the model, not measurements; `make gpu-check` puts a GPU's measured maximum
beside the planner's figure for the same shape.

Run: PYTHONPATH=. python benchmarks/longest_plan.py        (about a minute)
     PYTHONPATH=. python benchmarks/longest_plan.py --tasks    (DPO and GRPO beside SFT's longest)
"""

from __future__ import annotations

from hf_longctx.cli.inputs import load_config
from hf_longctx.capacity.search import Cluster, rank_settings

G = 2**30
MODELS = {"8B": "tests/data/llama-3.1-8b-config.json", "70B": "tests/data/llama-3-70b-config.json"}
CLUSTERS = [  # (GPUs, GPU GB, host GiB per node, {model: published figure})
    (1, 80, 512, {"8B": "ALST: 500K"}),
    (1, 141, 1024, {"8B": "ALST: 1.2M (one H200)"}),
    (4, 80, 2048, {"8B": "FPDT: 2M"}),
    (8, 80, 2048, {"8B": "ALST: 3.8M", "70B": "ALST: 200K"}),
    (32, 80, 2048, {"8B": "ALST: 15.5M"}),
    (64, 80, 2048, {}),
]


# (label, task, rollouts charged: None, or how they are generated) of the post-training rows; GRPO's trainer
# generates on the training GPUs always, so its training step alone is a bound to compare with, not a setting
# it runs. "sp": the SP group decodes one micro-batch's rows together (sp_generate; the cache on the device,
# else on the host), "sp-device": the cache kept on the device (decode at device speed); "per-rank": each
# GPU decodes rows of the context length with the whole model (generation="per-rank")
TASKS = [("DPO", "dpo", None), ("GRPO, training step alone", "grpo", None),
         ("GRPO, sequence-parallel rollouts", "grpo", "sp"),
         ("GRPO, sequence-parallel rollouts, cache on the device", "grpo", "sp-device"),
         ("GRPO, per-rank rollouts", "grpo", "per-rank")]


def _best(cfg, cluster: Cluster, tokens: int, task: str = "sft", rollouts: str | None = None):
    rollout = tokens if rollouts else 0  # the rollouts of one micro-batch of the context length
    generation, cache = ("sp", "device") if rollouts == "sp-device" else (rollouts or "sp", "auto")
    feasible = [c for c in rank_settings(cfg, cluster, tokens, task=task, rollout_tokens=rollout,
                                         generation=generation, rollout_cache=cache) if c.feasible]
    return feasible[0] if feasible else None


def longest(cfg, cluster: Cluster, quantum: int, task: str = "sft", rollouts: str | None = None):
    """(longest feasible length, its first-choice candidate); lengths are multiples of `quantum`."""
    lo, hi, best = 0, 1 if rollouts == "per-rank" else 1 << 5, None
    while (found := _best(cfg, cluster, hi * quantum, task, rollouts)) is not None:
        lo, best, hi = hi, found, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        found = _best(cfg, cluster, mid * quantum, task, rollouts)
        if found is not None:
            lo, best = mid, found
        else:
            hi = mid
    return lo * quantum, best


def main() -> None:
    print("| model | GPUs, host memory per node | planner's longest | its setting | peak GiB/GPU | host GiB/GPU "
          "| binds | published |")
    print("|---|---|---:|---|---:|---:|---|---|")
    for name, path in MODELS.items():
        cfg = load_config(path)
        for gpus, gpu, host, published in CLUSTERS:
            if name == "70B" and gpus < 8:
                continue
            cluster = Cluster(gpus=gpus, gpu_memory=gpu * G, host_memory=host * G)
            tokens, best = longest(cfg, cluster, 8192 * gpus)
            where = f"| {name} | {gpus} x {gpu} GB, {host} GiB host/node"
            if best is None:
                print(f"{where} | none | | | | | {published.get(name, '—')} |")
                continue
            s, per_node = best.setting, min(gpus, 8)
            gpu_use = best.memory.peak / cluster.gpu_memory
            host_use = best.memory.host * per_node / cluster.host_memory
            print(f"{where} | {tokens / 2**20:.2f}M "
                  f"| U{s.ulysses} x R{s.ring}, FPDT {s.fpdt_chunks}, {best.preset}"
                  f"{', param offload' if s.param_offload else ''}"
                  f"{f', inputs_on_device={s.inputs_on_device}' if s.inputs_on_device else ''} | {best.memory.peak / G:.1f} "
                  f"| {best.memory.host / G:.0f} | {'GPU' if gpu_use > host_use else 'host'} "
                  f"| {published.get(name, '—')} |", flush=True)


def _setting(best) -> str:
    s = best.setting
    return (f"U{s.ulysses} x R{s.ring}, FPDT {s.fpdt_chunks}, {best.preset}{', param offload' if s.param_offload else ''}"
            f"{f', inputs_on_device={s.inputs_on_device}' if s.inputs_on_device else ''}")


def post_training() -> None:
    """The longest DPO / GRPO micro-batch (a pair's or a group's documents together) beside SFT's,
    8B on each cluster and 70B on 8 GPUs: the reference's shards and forward, the chunked
    log-prob head, and the rollouts of one micro-batch on the training GPUs: sequence-parallel (the
    SP group's cache, 1/SP per GPU, weights gathered once or per unit) or per rank (one GPU holds a
    row of the context length and the whole model)."""
    print("\n| model | GPUs | task | planner's longest | its setting | peak GiB/GPU | / SFT's longest |")
    print("|---|---|---|---:|---|---:|---:|")
    for name, path in MODELS.items():
        cfg = load_config(path)
        for gpus, gpu, host, _ in CLUSTERS:
            if name == "70B" and gpus != 8:
                continue
            cluster = Cluster(gpus=gpus, gpu_memory=gpu * G, host_memory=host * G)
            sft, _ = longest(cfg, cluster, 8192 * gpus)
            for label, task, rollouts in TASKS:
                tokens, best = longest(cfg, cluster, 8192 if rollouts == "per-rank" else 8192 * gpus, task, rollouts)
                weights = (f", weights {best.memory.generation_weights}, cache on {best.memory.generation_cache}"
                           if best is not None and (rollouts or "").startswith("sp") else "")
                row = (f"{tokens / 2**20:.2f}M | {_setting(best)}{weights} | {best.memory.peak / G:.1f} | {tokens / sft:.2f}"
                       if best is not None else "none | | |")
                print(f"| {name} | {gpus} x {gpu} GB | {label} | {row} |", flush=True)


if __name__ == "__main__":
    import sys

    post_training() if "--tasks" in sys.argv else main()
