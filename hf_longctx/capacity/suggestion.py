"""`Suggestion`: one ranked setting as what to run -- `init_sequence_parallel` and `patch`
arguments, the trainer's keyword arguments, and the same as recipe flags.

Where it sits: the output end of the planner; `capacity/search.suggest()` returns one and
`hf-longctx plan` (`cli/capacity.py`) prints its `code()` and `recipe_flags()`. It reads a
`search.Candidate` (setting, dp, micro-batches, preset) and imports nothing of the search.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Suggestion:
    """What to run: `init_sequence_parallel(**init_kwargs)` then `patch(model, mesh, memory=memory)`."""

    init_kwargs: dict  # ulysses_degree, ring_degree, fpdt_chunks
    memory: str
    candidate: Any  # the search.Candidate it was made of
    trainer_kwargs: dict | None = None  # LongContextTrainer: max_tokens, tokens_per_step, param_offload, ...
    mixed_precision: str = "bf16"

    @classmethod
    def of(cls, c: Any, tokens: int | None = None, *, grad_sync: str = "step", dtype: str = "bf16") -> "Suggestion":
        """`tokens`: per SP group and micro-batch (the trainer's `max_tokens`)."""
        s = c.setting
        trainer = {"max_tokens": tokens, "tokens_per_step": tokens * c.dp * c.microbatches} if tokens else {}
        if s.param_offload:
            trainer["param_offload"] = True
        if grad_sync == "microbatch":
            trainer["sync_each_microbatch"] = True
        return cls({"ulysses_degree": s.ulysses, "ring_degree": s.ring, "fpdt_chunks": s.fpdt_chunks}, c.preset, c,
                   trainer, "fp32" if dtype == "fp32" else "bf16")

    def code(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.init_kwargs.items())
        kept = self.candidate.setting.inputs_on_device
        out = (f"mesh = hf_longctx.init_sequence_parallel({args})\nmodel = hf_longctx.patch(model, mesh, memory={self.memory!r}"
               + (f", inputs_on_device={kept})" if kept else ")"))
        if self.trainer_kwargs:
            kw = ", ".join(f"{k}={v}" for k, v in self.trainer_kwargs.items())
            out += f"\ntrainer = hf_longctx.LongContextTrainer(model=model, args=args, mesh=mesh, {kw}, ...)"
        return out

    def recipe_flags(self) -> str:
        """The same setting as flags of recipes/pretrain.py, lora.py and sft.py (recipes/common.py)."""
        k, t = self.init_kwargs, self.trainer_kwargs or {}
        flags = [f"--ulysses {k['ulysses_degree']}", f"--ring {k['ring_degree']}", f"--fpdt-chunks {k['fpdt_chunks']}",
                 f"--memory {self.memory}"]
        if self.candidate.setting.inputs_on_device:
            flags.append(f"--inputs-on-device {self.candidate.setting.inputs_on_device}")
        if "max_tokens" in t:
            flags += [f"--max-tokens {t['max_tokens']}", f"--tokens-per-step {t['tokens_per_step']}"]
        flags += [f"--mixed-precision {self.mixed_precision}"]
        flags += ["--param-offload"] if t.get("param_offload") else []
        flags += ["--sync-each-microbatch"] if t.get("sync_each_microbatch") else []
        return " ".join(flags)
