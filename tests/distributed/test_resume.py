"""Checkpoint/resume through `LongContextTrainer` on 4 gloo ranks (DP 2 × ring 2, FSDP2, fp32).

Run A trains 5 steps uninterrupted. Run B has the same 5-step schedule but a callback stops it
after step 2, when `save_steps=2` has written `checkpoint-2/` (every rank's model and AdamW
shards via torch distributed checkpoint, the step sampler's position, the Trainer's scheduler,
per-rank RNG and trainer state, and the mark that every rank's files are written). Run C is a
fresh model and trainer in the same processes, `train(resume_from_checkpoint=...)`. The logged
(loss, grad_norm) of B's steps 1-2 and C's steps 3-5 must equal A's EXACTLY: on CPU in fp32 the
same inputs give bit-identical results,
so any difference means a state was not restored (an optimizer moment of any rank, the
schedule position, the sampler position, a shard). Resumed steps run at cosine factors < 1,
so a lost schedule position changes C's losses from its 2nd step on.

`save_model()` of A writes a consolidated `save_pretrained` directory; it must load with
plain `from_pretrained` (unpatched) and equal the single-process trainer's saved weights.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.families import save_family
from tests.helpers.pool import worker_mesh
from tests.helpers.trainer_cases import history, make_dataset, training_args

STEPS, STOP = 5, 2


def _run(path: str, output_dir: str, mode: str, distributed: bool = True) -> dict:
    from transformers import AutoModelForCausalLM, TrainerCallback

    from hf_longctx import LongContextTrainer, init_sequence_parallel, patch

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == STOP:
                control.should_training_stop = True

    save = dict(save_strategy="steps", save_steps=STOP) if mode == "first" else {}
    args = training_args(output_dir, max_steps=STEPS, **save)
    mesh = worker_mesh(1, 2) if distributed else init_sequence_parallel()
    model = patch(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), mesh)
    trainer = LongContextTrainer(model=model, args=args, train_dataset=make_dataset(), mesh=mesh, max_tokens=48,
                                 tokens_per_step=120, callbacks=[StopAt()] if mode == "first" else None)
    resume = os.path.join(output_dir, f"checkpoint-{STOP}") if mode == "second" else None
    trainer.train(resume_from_checkpoint=resume)
    out = {"steps": history(trainer)}
    if mode == "full":
        trainer.save_model(os.path.join(output_dir, "final"))
    if mode == "first":
        out["files"] = sorted(os.listdir(os.path.join(output_dir, f"checkpoint-{STOP}")))
    return out


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return save_family("llama", tmp_path_factory.mktemp("resume"))


def test_stopped_and_resumed_run_matches_uninterrupted(pools, llama_path, tmp_path):
    from transformers import AutoModelForCausalLM

    pool = pools.get(4)
    full = pool.run(_run, llama_path, str(tmp_path / "a"), "full", timeout=600)
    first = pool.run(_run, llama_path, str(tmp_path / "b"), "first", timeout=600)
    second = pool.run(_run, llama_path, str(tmp_path / "b"), "second", timeout=600)
    for rank in range(4):
        assert len(full[rank]["steps"]) == STEPS and full[rank]["steps"] == full[0]["steps"]
        assert first[rank]["steps"] == full[rank]["steps"][:STOP], f"rank {rank}: {first[rank]['steps']}"
        # the resumed log history: steps 1-2 from checkpoint-2's trainer_state.json, 3-5 trained now
        assert second[rank]["steps"] == full[rank]["steps"], (
            f"rank {rank}: resumed {second[rank]['steps'][STOP:]} != uninterrupted {full[rank]['steps'][STOP:]}"
        )
    files = set(first[0]["files"])
    assert {"hf_longctx_dcp", "hf_longctx_sampler.json", "scheduler.pt", "trainer_state.json",
            "hf_longctx_checkpoint.json"} <= files, files
    assert {f"rng_state_{r}.pth" for r in range(4)} <= files, files

    # the consolidated model: plain from_pretrained, equal to the single-process trainer's
    _run(llama_path, str(tmp_path / "ref"), "full", distributed=False)
    got = AutoModelForCausalLM.from_pretrained(str(tmp_path / "a" / "final"), dtype=torch.float32)
    want = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ref" / "final"), dtype=torch.float32)
    assert got.config._attn_implementation != "" and "hf_longctx" not in str(got.config._attn_implementation)
    for (name, a), (_, b) in zip(got.named_parameters(), want.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_resume_refuses_a_foreign_checkpoint(tmp_path):
    from hf_longctx.training.base.saving import load_sharded

    (tmp_path / "checkpoint-3").mkdir()  # e.g. written by a stock Trainer, or a crash while saving
    with pytest.raises(ValueError, match="not written by a LongContextTrainer"):
        load_sharded(str(tmp_path / "checkpoint-3"), model=None, optimizer=None, sampler=None)
