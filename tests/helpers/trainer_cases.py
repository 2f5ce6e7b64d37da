"""Shared pieces of the trainer tests: data, the env a Trainer needs in a pool worker, one run,
the bf16 step tolerance (BF16_TOL).

A `transformers.Trainer` learns about the process group from `TrainingArguments`, whose
Accelerate `PartialState` reads the launcher's environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE), not torch.distributed: the pool's workers initialise gloo themselves
(file:// rendezvous, no env), so `trainer_env()` writes those variables from the live group
before `TrainingArguments` is built; PartialState then takes the MULTI_CPU path and adopts
the already-initialised group instead of creating one. OMP_NUM_THREADS=1 stops Accelerate
from re-setting torch's thread count. In the pytest process itself (no group) nothing is set
and the same code runs the single-process reference.
"""

from __future__ import annotations

import os
from typing import Any

import torch

VOCAB = 128
# bf16 steps vs the single-process bf16 trainer: one bf16 rounding step (2^-8 relative) on the
# logged loss and grad_norm. Measured on 4 ranks (u2xr2): loss within 2.7e-5, grad_norm within
# 8.8e-4; a normaliser off by one target of the ~100 per step, or a lost document, is >= 1e-2.
BF16_TOL = 2.0**-8


def trainer_env() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def make_dataset(n_docs: int = 24, seed: int = 0, *, masked: bool = False):
    """Documents of 3..39 tokens; `masked`: the first third of every other one carries no loss."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n_docs,), generator=g).tolist()
    ids = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]
    cols: dict[str, Any] = {"input_ids": ids}
    if masked:
        cols["labels"] = [[-100] * (len(x) // 3) + x[len(x) // 3 :] if d % 2 else x for d, x in enumerate(ids)]
    return Dataset.from_dict(cols)


def training_args(output_dir: str, **kw: Any):
    from transformers import TrainingArguments

    trainer_env()
    defaults = dict(
        output_dir=output_dir, max_steps=3, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=1,
        logging_steps=1, max_grad_norm=1.0, report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no",
        seed=0,
    )
    return TrainingArguments(**{**defaults, **kw})


def history(trainer) -> list[tuple[float, float]]:
    """(loss, grad_norm) of every logged training step."""
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]


def assert_steps_close(got: list, want: list, tol: float, what: str = "") -> None:
    assert len(got) == len(want) and got, f"{what}: {len(got)} logged steps vs {len(want)}"
    for i, ((l1, g1), (l2, g2)) in enumerate(zip(got, want)):
        assert abs(l1 - l2) <= tol * abs(l2), f"{what} step {i + 1}: loss {l1} vs single-process {l2}"
        assert abs(g1 - g2) <= tol * abs(g2), f"{what} step {i + 1}: grad_norm {g1} vs single-process {g2}"
