"""`Suggestion`: one ranked setting as what to run -- `init_sequence_parallel` and `patch`
arguments, the keyword arguments of the task's trainer, and the same as flags of the task's
recipes -- and `TASK_TRAINERS`, what each `--task`'s trainer takes.

Where it sits: the output end of the planner; `capacity/search.rank_settings(task=)` reads
`TASK_TRAINERS` to search only settings the task's trainer runs, `search.suggest()` returns a
`Suggestion` and `hf-longctx plan` (`cli/capacity.py`) prints its `code()` and
`recipe_flags()`; `task_options` and `rollouts_of` are the search's options for a task's
trainer. Guarantees: the code names the task's trainer with its real keyword arguments, and
every printed flag is one the task's recipes parse (recipes/common.py and each recipe's own
options). It reads a `search.Candidate` and imports nothing of the search.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TaskTrainer:
    """The trainer of one `--task` as the planner needs it: its class and config in the printed
    code, the recipes whose parsers take the printed flags, and the options it takes.

    `tokens_per_step`: takes `tokens_per_step=` (the rollout trainers' steps are TRL's rows);
    `trainer_options`: takes `param_offload=` and `sync_each_microbatch=` (the rollout trainers
    take neither: their shards stay on the device and their step loop reduce-scatters in every
    micro-batch's backward always); `flexible_groups`: takes a `GroupBank` (`unequal_calls=`);
    `unit`: what its `max_tokens` (and `tokens_per_step`) count, printed under the code;
    `recipe_flags`: flags its recipe needs beyond the setting's (the precomputed reference's)."""

    name: str
    config: str
    recipes: str
    unit: str
    tokens_per_step: bool = True
    trainer_options: bool = True
    flexible_groups: bool = False
    recipe_flags: tuple = ()

    @property
    def always_syncs_each_microbatch(self) -> bool:
        return not self.trainer_options


_ROWS = ("max_tokens: prompt + completion tokens of one packed micro-batch of an SP group; a step's rows are "
         "TRL's (per_device_train_batch_size x processes)")
TASK_TRAINERS = {
    "sft": TaskTrainer("LongContextTrainer", "args", "recipes/pretrain.py, lora.py, sft.py", "", flexible_groups=True),
    "dpo": TaskTrainer("LongDPOTrainer", "DPOConfig(..., max_length=None)", "recipes/dpo.py",
                       "max_tokens and tokens_per_step count whole pairs (chosen + rejected); a pair is never split"),
    "dpo-precomputed": TaskTrainer(
        "LongDPOTrainer", "DPOConfig(..., max_length=None, precompute_ref_log_probs=True)", "recipes/dpo.py",
        "max_tokens and tokens_per_step count whole pairs (chosen + rejected); a pair is never split; the reference "
        "scores every pair once at construction and is not held during training",
        recipe_flags=("--precompute-ref-log-probs",)),
    "grpo": TaskTrainer("LongGRPOTrainer", "GRPOConfig(...)", "recipes/grpo.py", _ROWS, tokens_per_step=False,
                        trainer_options=False),
    "rloo": TaskTrainer("LongRLOOTrainer", "RLOOConfig(...)", "recipes/rloo.py", _ROWS, tokens_per_step=False,
                        trainer_options=False),
}


def task_trainer(task: str) -> TaskTrainer:
    if task not in TASK_TRAINERS:
        raise ValueError(f"task must be one of {sorted(TASK_TRAINERS)}, got {task!r}")
    return TASK_TRAINERS[task]


@dataclass(frozen=True)
class Suggestion:
    """What to run: `init_sequence_parallel(**init_kwargs)`, `patch(model, mesh, memory=memory)`,
    then the task's trainer with `trainer_kwargs`."""

    init_kwargs: dict  # ulysses_degree, ring_degree, fpdt_chunks
    memory: str
    candidate: Any  # the search.Candidate it was made of
    trainer_kwargs: dict | None = None  # the task's trainer: max_tokens, tokens_per_step, param_offload, ...
    mixed_precision: str = "bf16"
    task: str = "sft"  # a key of TASK_TRAINERS

    @classmethod
    def of(cls, c: Any, tokens: int | None = None, *, grad_sync: str = "step", dtype: str = "bf16",
           task: str = "sft") -> "Suggestion":
        """`tokens`: per SP group and micro-batch (the trainer's `max_tokens`); `task`: whose
        trainer and recipes (`TASK_TRAINERS`). A setting the task's trainer cannot run is refused."""
        s, t = c.setting, task_trainer(task)
        trainer = {"max_tokens": tokens} if tokens else {}
        if tokens and t.tokens_per_step:
            trainer["tokens_per_step"] = tokens * c.dp * c.microbatches
        if s.param_offload:
            if not t.trainer_options:
                raise ValueError(f"{t.name} takes no param_offload: plan --task {task} without parameter offload")
            trainer["param_offload"] = True
        if grad_sync == "microbatch" and t.trainer_options:  # the rollout trainers do it always: no option
            trainer["sync_each_microbatch"] = True
        memory = getattr(c, "memory", None)
        if memory is not None and memory.generation and not memory.generation_weights:  # rollouts planned per rank
            trainer["generation"] = "'per-rank'"
        return cls({"ulysses_degree": s.ulysses, "ring_degree": s.ring, "fpdt_chunks": s.fpdt_chunks}, c.preset, c,
                   trainer, "fp32" if dtype == "fp32" else "bf16", task)

    def code(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.init_kwargs.items())
        s = self.candidate.setting
        extra = (", keep_attention=True" if s.keep_attention else "") + (
            f", inputs_on_device={s.inputs_on_device}" if s.inputs_on_device else "") + (
            f", loss_chunk_rows={s.loss_chunk_rows}" if s.loss_chunk_rows else "")
        out = (f"mesh = hf_longctx.init_sequence_parallel({args})\nmodel = hf_longctx.patch(model, mesh, memory={self.memory!r}"
               + extra + ")")
        if self.trainer_kwargs:
            kw = ", ".join(f"{k}={v}" for k, v in self.trainer_kwargs.items())
            t = TASK_TRAINERS[self.task]
            out += f"\ntrainer = hf_longctx.{t.name}(model=model, args={t.config}, mesh=mesh, {kw}, ...)"
            out += f"\n# {t.unit}" if t.unit else ""
        memory = getattr(self.candidate, "memory", None)
        if memory is not None and memory.generation_weights:  # what sp_generate's "auto" rule places, as planned
            cache = "device" if memory.generation_cache == "device" else "host (pinned; read over PCIe every decode step)"
            weights = "gathered once per rollout" if memory.generation_weights == "gathered" else "FSDP2-gathered per unit"
            out += f"\n# rollouts: sequence-parallel, weights {weights}, K/V cache on the {cache}"
        return out

    @property
    def recipes(self) -> str:
        """The recipes whose parsers take `recipe_flags()`."""
        return TASK_TRAINERS[self.task].recipes

    def recipe_flags(self) -> str:
        """The same setting as flags of the task's recipes (`recipes`: recipes/common.py's shared
        options plus --max-tokens, and --tokens-per-step where the trainer takes it)."""
        k, t = self.init_kwargs, self.trainer_kwargs or {}
        flags = [f"--ulysses {k['ulysses_degree']}", f"--ring {k['ring_degree']}", f"--fpdt-chunks {k['fpdt_chunks']}",
                 f"--memory {self.memory}"]
        if self.candidate.setting.inputs_on_device:
            flags.append(f"--inputs-on-device {self.candidate.setting.inputs_on_device}")
        flags += ["--keep-attention"] if self.candidate.setting.keep_attention else []
        rows = self.candidate.setting.loss_chunk_rows
        flags += [f"--loss-chunk-rows {rows}"] if rows else []
        flags += [f"--max-tokens {t['max_tokens']}"] if "max_tokens" in t else []
        flags += [f"--tokens-per-step {t['tokens_per_step']}"] if "tokens_per_step" in t else []
        flags += [f"--mixed-precision {self.mixed_precision}"]
        flags += ["--param-offload"] if t.get("param_offload") else []
        flags += ["--sync-each-microbatch"] if t.get("sync_each_microbatch") else []
        flags += ["--generation per-rank"] if "generation" in t else []
        return " ".join(flags + list(TASK_TRAINERS[self.task].recipe_flags))


def task_options(task: str, param_offload: str, grad_sync: str, unsharded_step: bool) -> tuple[str, str]:
    """(param_offload, grad_sync) the search uses for `task`'s trainer (`rank_settings`); raises
    ValueError, naming the trainer, for an option it does not take."""
    t = task_trainer(task)
    if unsharded_step and not t.flexible_groups:
        raise ValueError(f"unsharded_step (--unequal-calls) plans flexible SP groups, which {t.name} does not take "
                         f"(it trains on an SPMesh); leave it off for task {task!r}")
    if t.trainer_options:
        return param_offload, grad_sync
    if param_offload == "yes":
        raise ValueError(f"param_offload 'yes' (--param-offload yes): {t.name} takes no param_offload (its FSDP2 shards "
                         f"and optimizer states stay on the device); plan task {task!r} with 'no' or 'auto' (which "
                         "tries it off only for this task)")
    return "no", "microbatch"  # the rollout trainers reduce-scatter in every micro-batch's backward always


def rollouts_of(task: str, rollout_tokens: int | None, seq_len: int) -> int:
    """The rollout tokens a plan of `task` charges per generation (the SP group's, or one GPU's on the
    per-rank path): None -> `seq_len` for "grpo" / "rloo" (a micro-batch's worth of prompts and
    completions), 0 otherwise; a count below 0, or one for a task that generates nothing, is refused."""
    rollouts = task in ("grpo", "rloo")
    if rollout_tokens is None:
        return seq_len if rollouts else 0
    if rollout_tokens < 0 or (rollout_tokens and not rollouts):
        raise ValueError(f"rollout_tokens={rollout_tokens}: the prompt + completion tokens one generation decodes per "
                         f"step for task 'grpo' or 'rloo' (>= 0); task {task!r} generates nothing: leave it None")
    return rollout_tokens
