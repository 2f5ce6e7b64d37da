"""A rank killed while a checkpoint is being written: resume takes the newest COMPLETE one.

The test starts its OWN 2-rank gloo jobs (the shared pool must not lose a rank): this file run
as a script is the worker. Every job trains a tiny patched Llama (Ulysses 2, FSDP2 over both
ranks, fp32) through `LongContextTrainer` for 6 steps, `save_steps=2`, `save_total_limit=1`,
with a 10 s process-group timeout. Jobs:

- "full": uninterrupted; its logged (loss, grad_norm) per step is the reference.
- "crash-shards": rank 1 exits inside checkpoint-4's save before writing its shards (the
  folder holds no trainer_state.json; rank 0 stops on the failed collective).
- "crash-rng": rank 1 exits inside checkpoint-4's save after every shard was written, before
  its own RNG file; rank 0 writes trainer_state.json, so the folder looks complete to the
  Trainer, yet one rank's part is missing.
- "resume": a fresh job in the same output_dir with `train(resume_from_checkpoint=True)`.

After a crash checkpoint-2 must survive (an incomplete checkpoint-4 never rotates it away);
the resumed job must say on rank 0 that it skipped checkpoint-4, train from checkpoint-2, log
every step EXACTLY as the uninterrupted job (CPU fp32: bit-identical), and leave only the
newest complete checkpoint under save_total_limit=1. Every job is bounded: past its deadline
each process group is killed (tests/helpers/launcher.py) and the test fails instead of hanging.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile

import pytest

from tests.helpers.launcher import start, wait_all

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORLD, STEPS, SAVE_EVERY, CRASH_AT = 2, 6, 2, 4
TIMEOUT_S = 10.0  # the process-group timeout: how long rank 0 waits for the dead rank
JOB_S = 300  # outer bound of one job on a loaded 2-core machine (imports, 6 tiny steps)
DEAD_EXIT = 17


def _worker(rank: int, world: int, init_file: str, mode: str, output_dir: str, result_file: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_longctx import LongContextTrainer, init_sequence_parallel, patch
    from tests.helpers.trainer_cases import history, make_dataset, training_args

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))

    def die(where: str, step: int) -> None:
        if rank == 1 and step == CRASH_AT and mode == f"crash-{where}":
            print(f"rank {rank}: dying inside checkpoint-{step}'s save ({where})", flush=True)
            os._exit(DEAD_EXIT)

    class Faulty(LongContextTrainer):
        def _save_optimizer_and_scheduler(self, output_dir):
            die("shards", self.state.global_step)
            super()._save_optimizer_and_scheduler(output_dir)

        def _save_rng_state(self, output_dir):
            die("rng", self.state.global_step)
            super()._save_rng_state(output_dir)

    args = training_args(output_dir, max_steps=STEPS, save_strategy="steps", save_steps=SAVE_EVERY,
                         save_total_limit=1)
    mesh = init_sequence_parallel(ulysses_degree=world)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    trainer = Faulty(model=patch(model, mesh), args=args, train_dataset=make_dataset(), mesh=mesh, max_tokens=48,
                     tokens_per_step=60)
    trainer.train(resume_from_checkpoint=True if mode == "resume" else None)
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump({"steps": history(trainer)}, f)
    print(f"rank {rank}: finished all steps", flush=True)


def _job(tmp_path, mode: str, output_dir: str) -> tuple[list[int], list[str], dict | None]:
    """Run one 2-rank job; its exit codes, each rank's output, rank 0's result (None: none written)."""
    fd, init_file = tempfile.mkstemp(prefix="hf_longctx_save_")
    os.close(fd)
    os.unlink(init_file)
    result = tmp_path / f"{mode}.json"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    logs = [tmp_path / f"{mode}.rank{r}.log" for r in range(WORLD)]
    handles = [open(p, "w") for p in logs]
    try:
        procs = [start([sys.executable, "-m", "tests.distributed.test_interrupted_save", str(r), str(WORLD), init_file,
                        mode, output_dir, str(result)], handles[r], env, ROOT) for r in range(WORLD)]
        codes = wait_all(procs, timeout_s=JOB_S)
    finally:
        for h in handles:
            h.close()
        if os.path.exists(init_file):
            os.unlink(init_file)
    outs = [p.read_text() for p in logs]
    return codes, outs, json.loads(result.read_text()) if result.exists() else None


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    codes, outs, result = _job(tmp, "full", str(tmp / "out"))
    assert codes == [0] * WORLD, outs[0][-3000:] + outs[1][-3000:]
    assert len(result["steps"]) == STEPS, result
    return result["steps"]


@pytest.mark.parametrize("where", ["shards", "rng"])
def test_resume_skips_the_checkpoint_a_dead_rank_left_incomplete(uninterrupted, tmp_path, where):
    out_dir = tmp_path / "out"
    codes, outs, _ = _job(tmp_path, f"crash-{where}", str(out_dir))
    assert codes[1] == DEAD_EXIT, outs[1][-3000:]
    assert codes[0] not in (0, None) and "finished all steps" not in outs[0], outs[0][-3000:]
    partial = out_dir / f"checkpoint-{CRASH_AT}"
    assert partial.is_dir(), sorted(os.listdir(out_dir))
    if where == "rng":  # complete by the Trainer's own standard, though rank 1's part is missing
        assert (partial / "trainer_state.json").exists() and not (partial / "rng_state_1.pth").exists()
    else:
        assert not (partial / "trainer_state.json").exists()
    done = out_dir / f"checkpoint-{SAVE_EVERY}"
    assert (done / "trainer_state.json").exists(), (
        f"the complete checkpoint-{SAVE_EVERY} was rotated away: {sorted(os.listdir(out_dir))}")

    codes, outs, result = _job(tmp_path, "resume", str(out_dir))
    assert codes == [0] * WORLD, outs[0][-3000:] + outs[1][-3000:]
    said = [line for line in outs[0].splitlines() if "skipping" in line and f"checkpoint-{CRASH_AT}" in line]
    assert said and f"checkpoint-{SAVE_EVERY}" in said[0], outs[0][-3000:]
    assert not any("skipping" in line for line in outs[1].splitlines()), "announced on rank 0 only"
    # steps 1-2 come from checkpoint-2's trainer_state.json, 3-6 are trained again: all bit-identical
    assert result["steps"] == uninterrupted, f"resumed {result['steps']} != uninterrupted {uninterrupted}"
    kept = sorted(d for d in os.listdir(out_dir) if re.fullmatch(r"checkpoint-\d+", d))
    assert kept == [f"checkpoint-{STEPS}"], kept


if __name__ == "__main__":
    from hf_longctx.training.launch import run_rank

    # run_rank ends a finished rank as the recipes do (training/launch.exit_rank: without the
    # interpreter finalisation in which a gloo worker thread can abort the process after the last step)
    run_rank(lambda: _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]))
