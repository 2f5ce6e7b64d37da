"""Checkpoint/resume of `LongGRPOTrainer` (training/grpo/resume.py) on 4 gloo ranks (U2xR2, FSDP2, fp32).

Run A trains 3 steps uninterrupted with save_steps=1 (checkpoint-1, -2, -3). Run B is a fresh
model and trainer in the same processes, `train(resume_from_checkpoint=A/checkpoint-1)`: it trains
steps 2 and 3; run C resumes from A/checkpoint-2 and trains step 3. 12 prompts, 6 per step: an
epoch is 2 steps, so B resumes inside epoch 0 (the Trainer skips the trained step) and C at the
epoch boundary (TRL's sampler must draw epoch 1's order, not replay epoch 0's).

What must be restored for the resumed steps to equal A's: every rank's AdamW moments (AdamW,
lr 1e-2, linear decay: a lost moment or schedule position changes the update), the policy shards,
TRL's sampler position (the rows), and each rank's RNG: completions are "sampled" with torch's
global generator of the rank (`RandomCompletions`), so a lost RNG state changes the rows'
completions, rewards, advantages and loss. beta = 0.04 with a reference that differs from the
policy: the reference is not in the checkpoint, TRL rebuilds it from the policy's path.

Asserted per rank: the resumed steps' (prompt, completion) rows equal A's for the same step
(and differ between steps: the test is not vacuous); loss 1e-5 relative, grad_norm and every
parameter after each resumed step 1e-4 relative (measured: bit-identical). Also: `save_model`
still writes a consolidated directory that loads unpatched with `from_pretrained` and equals the
trained parameters, and a checkpoint holds no consolidated model (only the sharded states); a
resume whose reference comes from another path, or from a checkpoint LongGRPOTrainer did not
write, is refused before any collective. The same three runs on a one-process mesh (no FSDP2), and
save_strategy="epoch" (checkpoint-2 at the epoch's end, step 3 resumed) in one process.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.grpo_cases import make_prompts, paths, reward_length, reward_tokens  # noqa: F401
from tests.helpers.families import rel
from tests.helpers.word_tokenizer import WORDS
from tests.helpers.pool import worker_mesh
from tests.helpers.trainer_cases import trainer_env

STEPS, ROWS, GENERATIONS, EOS = 3, 3, 2, 1
LOSS_TOL, TOL = 1e-5, 1e-4


def _run(model_path: str, ref_path: str, tok_path: str, out_dir: str, resume: str | None, final: bool,
         mesh_shape: tuple[int, int] = (2, 2), save_strategy: str = "steps") -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig

    from hf_longctx import patch
    from hf_longctx.training.grpo.trainer import LongGRPOTrainer

    trainer_env()
    rows: list[list[tuple]] = []  # per generation call: this rank's (prompt, completion) rows
    params: dict[int, dict[str, torch.Tensor]] = {}  # global step -> every full parameter after it

    class RandomCompletions(LongGRPOTrainer):
        """TRL's generation replaced by completions drawn from this rank's global torch RNG."""

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            out = []
            for p in prompt_ids:
                n = int(torch.randint(1, 9, (1,)))
                ids = torch.randint(2, 2 + len(WORDS), (n,)).tolist()
                out.append(ids[:-1] + [EOS] if n % 3 else ids)
            rows.append([(tuple(p), tuple(c)) for p, c in zip(prompt_ids, out)])
            return out, None

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):  # every rank: full_tensor is a collective
            params[state.global_step] = {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                                         for k, p in model.named_parameters()}

    import torch.distributed as dist

    processes = dist.get_world_size() if dist.is_initialized() else 1  # the step's 4 x ROWS rows over them
    cfg = GRPOConfig(output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=4 * ROWS // processes,
                     num_generations=GENERATIONS, max_completion_length=16, loss_type="dapo", beta=0.04,
                     learning_rate=1e-2, lr_scheduler_type="linear", max_grad_norm=1.0, logging_steps=1, report_to=[],
                     use_cpu=True, disable_tqdm=True, save_strategy=save_strategy, save_steps=1, seed=0, bf16=False,
                     gradient_checkpointing=False)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.config._name_or_path = ref_path  # TRL builds the (frozen) reference from it, in every run alike
    mesh = worker_mesh(*mesh_shape)
    trainer = RandomCompletions(model=patch(model, mesh), mesh=mesh, reward_funcs=[reward_length, reward_tokens],
                                args=cfg, train_dataset=make_prompts(), callbacks=[Snapshot()],
                                processing_class=AutoTokenizer.from_pretrained(tok_path))
    trainer.train(resume_from_checkpoint=resume)
    logs = {h["step"]: (h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h}
    kl = [h["kl"] for h in trainer.state.log_history if "kl" in h]
    out = {"logs": logs, "rows": rows, "params": params, "kl": kl}
    if final:
        trainer.save_model(os.path.join(out_dir, "final"))  # a collective
        if dist.is_initialized():
            dist.barrier()
        saved = AutoModelForCausalLM.from_pretrained(os.path.join(out_dir, "final"), dtype=torch.float32)
        out["saved_diff"] = max((saved.get_parameter(k) - v).abs().max().item() for k, v in params[STEPS].items())
        out["saved_attn"] = str(saved.config._attn_implementation)
        out["files"] = sorted(os.listdir(os.path.join(out_dir, "checkpoint-1")))
    return out


def _runs(model_path: str, ref_path: str, tok_path: str, root: str, mesh_shape: tuple[int, int] = (2, 2)) -> dict:
    full = _run(model_path, ref_path, tok_path, f"{root}/a", None, True, mesh_shape)
    return {"full": full,
            "from1": _run(model_path, ref_path, tok_path, f"{root}/b", f"{root}/a/checkpoint-1", False, mesh_shape),
            "from2": _run(model_path, ref_path, tok_path, f"{root}/c", f"{root}/a/checkpoint-2", False, mesh_shape)}


def test_grpo_resumed_steps_equal_uninterrupted(pools, paths, tmp_path):  # noqa: F811
    _check(pools.get(4).run(_runs, *paths, str(tmp_path), timeout=600), ranks=4)


def test_grpo_resume_one_process(paths, tmp_path):  # noqa: F811
    """The same on a one-process mesh (no FSDP2: plain tensors through the same checkpoint files)."""
    _check([_runs(*paths, str(tmp_path), (1, 1))], ranks=1)


def test_grpo_resume_epoch_checkpoints_one_process(paths, tmp_path):  # noqa: F811
    """save_strategy="epoch" (2 steps per epoch): checkpoint-2 at the epoch's end; resuming from it
    trains step 3 on the uninterrupted run's rows with the same loss, grad_norm and parameters."""
    full = _run(*paths, str(tmp_path / "a"), None, False, (1, 1), "epoch")
    assert (tmp_path / "a" / "checkpoint-2").is_dir() and not (tmp_path / "a" / "checkpoint-1").exists()
    got = _run(*paths, str(tmp_path / "b"), str(tmp_path / "a" / "checkpoint-2"), False, (1, 1), "epoch")
    assert got["rows"] == full["rows"][2:] and full["rows"][2] != full["rows"][0], (got["rows"], full["rows"])
    assert got["logs"][3][0] == pytest.approx(full["logs"][3][0], rel=LOSS_TOL, abs=1e-8), (got["logs"], full["logs"])
    assert got["logs"][3][1] == pytest.approx(full["logs"][3][1], rel=TOL), (got["logs"], full["logs"])
    worst = max((rel(got["params"][3][k], v), k) for k, v in full["params"][3].items())
    assert worst[0] <= TOL, f"parameter rel err {worst}"


def _check(results: list[dict], ranks: int) -> None:
    for rank, res in enumerate(results):
        full = res["full"]
        assert sorted(full["logs"]) == [1, 2, 3] and min(full["kl"]) > 0, f"rank {rank}: {full['logs']} kl {full['kl']}"
        assert len({tuple(r) for r in full["rows"]}) == STEPS, f"rank {rank}: steps trained identical rows"
        for name, start in (("from1", 1), ("from2", 2)):
            got = res[name]
            where = f"rank {rank} resumed from checkpoint-{start}"
            assert sorted(got["logs"]) == [1, 2, 3], f"{where}: {got['logs']}"  # 1..start from trainer_state.json
            assert got["rows"] == full["rows"][start:], f"{where}: rows {got['rows']} vs {full['rows'][start:]}"
            for step in range(start + 1, STEPS + 1):
                (loss, norm), (want_loss, want_norm) = got["logs"][step], full["logs"][step]
                assert abs(loss - want_loss) <= LOSS_TOL * abs(want_loss) + 1e-8, \
                    f"{where} step {step}: loss {loss} vs {want_loss}"
                assert norm == pytest.approx(want_norm, rel=TOL), \
                    f"{where} step {step}: grad_norm {norm} vs {want_norm}"
                assert set(got["params"][step]) == set(full["params"][step])
                worst = max((rel(got["params"][step][k], v), k) for k, v in full["params"][step].items())
                assert worst[0] <= TOL, f"{where} step {step}: parameter rel err {worst}"
                moved = max((full["params"][step][k] - full["params"][step - 1][k]).abs().max().item()
                            for k in full["params"][step])
                assert moved > 1e-4, f"{where} step {step}: the step did not move the parameters ({moved})"
    full0 = results[0]["full"]
    assert full0["saved_diff"] == 0.0 and "hf_longctx" not in full0["saved_attn"], full0["saved_diff"]
    files = set(full0["files"])
    want = {"hf_longctx_dcp", "hf_longctx_grpo_reference.json", "scheduler.pt", "trainer_state.json",
            "hf_longctx_checkpoint.json"}
    want |= {f"rng_state_{r}.pth" for r in range(ranks)} if ranks > 1 else {"rng_state.pth"}
    assert want <= files, files
    assert not any(f.endswith(".safetensors") for f in files), f"a checkpoint gathered the consolidated model: {files}"


def test_grpo_resume_refuses_another_reference_or_a_foreign_checkpoint(tmp_path):
    import json
    from types import SimpleNamespace

    from hf_longctx.training.grpo.resume import REFERENCE_FILE, check_reference_source

    ref_model = SimpleNamespace(config=SimpleNamespace(_name_or_path="other/ref"))
    (tmp_path / "checkpoint-1").mkdir()  # e.g. written by a stock GRPOTrainer
    with pytest.raises(ValueError, match="not written by a LongGRPOTrainer"):
        check_reference_source(str(tmp_path / "checkpoint-1"), ref_model)
    (tmp_path / "checkpoint-1" / REFERENCE_FILE).write_text(json.dumps({"reference": "first/ref"}))
    with pytest.raises(ValueError, match="'first/ref'.*'other/ref'(.|\\n)*do instead"):
        check_reference_source(str(tmp_path / "checkpoint-1"), ref_model)
