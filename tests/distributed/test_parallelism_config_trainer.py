"""`LongContextTrainer` with Accelerate's `ParallelismConfig` instead of `mesh=`, on 4 gloo ranks.

The two entry points: `TrainingArguments(parallelism_config=...)` (ALST's `sp_size` with a
`sp_seq_length`) and the variables `accelerate launch` exports from a YAML's `parallelism_config:`
(Accelerate CP's `cp_size`). The model arrives unpatched and no mesh is passed: the trainer builds
the mesh the config maps to, patches the model, and trains 2 steps that equal the single-process
trainer's (fp32, 1e-5 relative, as tests/distributed/test_trainer.py argues). Accelerate never
acts on the config: the Trainer's Accelerator has none and the launcher's flag is back in the
environment after construction. A model patched with another SP degree is refused by field, and
so is a `dp_shard_size` that, times the SP degree, is not the world size (every factor named).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from tests.helpers.families import save_family
from tests.helpers.trainer_cases import assert_steps_close, history, make_dataset, training_args

TOL = 1e-5
LAUNCHER = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_CP_SIZE": "4",
            "PARALLELISM_CONFIG_CP_BACKEND": "torch", "PARALLELISM_CONFIG_CP_COMM_STRATEGY": "alltoall"}


def _train(path: str, output_dir: str, config: str | None) -> dict:
    """2 steps; `config`: None (one process, mesh of 1: the reference), "args" or "launcher"."""
    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from transformers import AutoModelForCausalLM

    from hf_longctx import LongContextTrainer, init_sequence_parallel, patch

    kw = {}
    if config == "args":
        kw["parallelism_config"] = ParallelismConfig(
            sp_size=2, dp_shard_size=2, sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length=48))
    args = training_args(output_dir, max_steps=2, **kw)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trainer_kw = dict(max_tokens=None if config == "args" else 48, tokens_per_step=120)
    if config is None:
        trainer_kw["mesh"] = init_sequence_parallel()
        patch(model, trainer_kw["mesh"])
    saved = {k: os.environ.get(k) for k in LAUNCHER}
    if config == "launcher":
        os.environ.update(LAUNCHER)
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            trainer = LongContextTrainer(model=model, args=args, train_dataset=make_dataset(masked=True), **trainer_kw)
        after = {k: os.environ.get(k) for k in LAUNCHER}
        trainer.train()
    finally:
        for k, v in saved.items():  # the pool's workers live on: leave their environment as it was
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    mesh = trainer.mesh
    return {"steps": history(trainer), "degrees": (mesh.ulysses, mesh.ring, mesh.dp), "max_tokens": trainer.max_tokens,
            "accelerator_pc": trainer.accelerator.parallelism_config, "user_pc_kept": args.parallelism_config is not None,
            "trainer_pc": trainer.args.parallelism_config, "launcher_env_after": after,
            "said": [str(w.message) for w in said if "hf_longctx mesh" in str(w.message)]}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_family("llama", tmp_path_factory.mktemp("parallelism_config"))


@pytest.fixture(scope="module")
def reference(path, tmp_path_factory):
    return _train(path, str(tmp_path_factory.mktemp("ref")), None)


def _check(out: list, reference: dict, degrees: tuple, what: str) -> None:
    for rank, res in enumerate(out):
        assert res["degrees"] == degrees, (rank, res["degrees"])
        assert res["accelerator_pc"] is None and res["trainer_pc"] is None, rank
        assert_steps_close(res["steps"], reference["steps"], TOL, f"{what} rank {rank}")
    assert len(out[0]["said"]) == 1 and not any(r["said"] for r in out[1:]), [r["said"] for r in out]


def test_training_arguments_sp_size(pools, path, reference, tmp_path):
    """ALST's knobs: sp_size=2 -> Ulysses 2 (4 query heads, 4 ranks on the machine), dp_shard_size=2,
    sp_seq_length=48 -> max_tokens=48; the user's arguments keep their config."""
    out = pools.get(4).run(_train, path, str(tmp_path), "args", timeout=600)
    _check(out, reference, (2, 1, 2), "sp_size=2")
    assert all(r["max_tokens"] == 48 and r["user_pc_kept"] for r in out)
    said = out[0]["said"][0]
    assert "ParallelismConfig(dp_shard_size=2, sp_size=2, sp_backend='deepspeed')" in said and "ulysses 2 x ring 1 x dp 2" in said


def test_launcher_cp_size(pools, path, reference, tmp_path):
    """Accelerate CP from the launcher's variables: cp_size=4 -> a ring of 4; the flag is restored."""
    out = pools.get(4).run(_train, path, str(tmp_path), "launcher", timeout=600)
    _check(out, reference, (1, 4, 1), "cp_size=4")
    assert all(r["launcher_env_after"] == LAUNCHER for r in out)
    assert "cp_comm_strategy='alltoall'" in out[0]["said"][0] and "PARALLELISM_CONFIG_*" in out[0]["said"][0]


def _refusals(path: str, output_dir: str) -> list[str]:
    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from transformers import AutoModelForCausalLM

    from hf_longctx import LongContextTrainer, patch
    from tests.helpers.pool import worker_mesh

    messages = []
    model = patch(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), worker_mesh(2, 1))
    for pc, kw in ((ParallelismConfig(sp_size=4), {"max_tokens": 48}),
                   (ParallelismConfig(sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length=64)),
                    {"max_tokens": 48}),
                   (ParallelismConfig(sp_size=2, dp_shard_size=4), {"max_tokens": 48})):
        try:
            LongContextTrainer(model=model, args=training_args(output_dir, parallelism_config=pc),
                               train_dataset=make_dataset(), tokens_per_step=120, **kw)
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_disagreements_refused_by_field(pools, path, tmp_path):
    out = pools.get(4).run(_refusals, path, str(tmp_path), timeout=300)
    for messages in out:
        assert len(messages) == 3, messages
        assert "sp_size=4" in messages[0] and "ulysses 2 x ring 1 = 2" in messages[0] and "set sp_size=2" in messages[0]
        assert "max_tokens=48 and sp_seq_length=64" in messages[1]
        assert ("sp_size(2) × dp_shard_size(4) = 8 ≠ world size 4; do instead: dp_shard_size=2 (4 / sp_size(2)) or 1"
                in messages[2] and "or launch 8 processes" in messages[2]), messages[2]
