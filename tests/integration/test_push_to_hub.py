"""push_to_hub with the SP trainers (one process, and 4 gloo ranks with FSDP2; the upload recorded
instead of sent): what the Trainer uploads holds the consolidated model, from the main process
alone, and a checkpoint is pushed only once it is complete.

A checkpoint holds sharded states only (`training/base/saving.py`), so the Trainer's own push --
which copies the model files out of the checkpoint folder, inside `_save_checkpoint`, before the
folder's completion mark -- would upload no weights, and under hub_strategy="checkpoint" a folder
marked unfinished. Asserted at every upload: output_dir holds a model that `from_pretrained`
loads (equal to the trained parameters at the end), the checkpoint uploaded is complete
(`saved_folders.missing` empty), and the end-of-training `trainer.push_to_hub()` uploads the
trained weights too.
"""

from __future__ import annotations

import os

import pytest
import torch

from hf_longctx import LongContextTrainer, init_sequence_parallel, patch
from hf_longctx.training.base import saved_folders
from tests.helpers.families import save_family
from tests.helpers.trainer_cases import make_dataset, training_args


class _Done:
    def done(self) -> bool:
        return True

    def result(self) -> None:
        return None


class _Hub:
    """transformers' `hf_api()` stand-in: the repo "exists"; each upload_folder call records what
    the folder holds."""

    def __init__(self) -> None:
        self.uploads: list[dict] = []

    def create_repo(self, repo_id: str, **kw):
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def upload_folder(self, *, folder_path: str, path_in_repo: str | None = None, **kw) -> _Done:
        from transformers import AutoModelForCausalLM

        entry = {"folder": folder_path, "path_in_repo": path_in_repo, "files": sorted(os.listdir(folder_path))}
        if path_in_repo is None:  # the run's folder: the model as a user downloads it
            model = AutoModelForCausalLM.from_pretrained(folder_path, dtype=torch.float32)
            entry["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        else:  # a checkpoint folder
            entry["missing"] = saved_folders.missing(folder_path)
        self.uploads.append(entry)
        return _Done()


@pytest.fixture()
def hub(monkeypatch):
    import transformers
    import transformers.trainer

    recorder = _Hub()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: recorder)
    monkeypatch.setattr(transformers.Trainer, "create_model_card", lambda self, *a, **k: None)
    return recorder


def test_checkpoint_pushes_carry_the_consolidated_model_after_the_folder_is_complete(hub, tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_family("llama", tmp_path / "model")
    mesh = init_sequence_parallel()
    model = patch(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), mesh)
    out = str(tmp_path / "run")
    args = training_args(out, max_steps=2, save_strategy="steps", save_steps=1, push_to_hub=True,
                         hub_model_id="local/run", hub_strategy="checkpoint", warmup_steps=0)  # both steps train
    trainer = LongContextTrainer(model=model, args=args, train_dataset=make_dataset(), mesh=mesh, max_tokens=48,
                                 tokens_per_step=120)
    trainer.train()
    runs = [u for u in hub.uploads if u["path_in_repo"] is None]
    checkpoints = [u for u in hub.uploads if u["path_in_repo"] is not None]
    assert len(runs) == 2 and len(checkpoints) == 2, [(u["folder"], u["path_in_repo"]) for u in hub.uploads]
    for u in checkpoints:
        assert u["missing"] == [], u  # pushed once every rank's files are in and the folder is marked
        assert u["path_in_repo"] == "last-checkpoint"
    assert args.push_to_hub is True  # the user's setting, back after every save
    trained = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    initial = {n: p for n, p in AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters()}
    last = runs[-1]["weights"]  # step 2's push: the weights as trained (no step ran after it)
    assert last.keys() == trained.keys()
    for name in trained:
        torch.testing.assert_close(last[name], trained[name], rtol=0, atol=0)
    for before, after in ((initial, runs[0]["weights"]), (runs[0]["weights"], last)):  # each push after its step
        assert any(not torch.equal(before[n], after[n]) for n in initial)

    hub.uploads.clear()
    trainer.push_to_hub()  # end of training: every rank calls it; the main process uploads
    (final,) = hub.uploads
    for name in trained:
        torch.testing.assert_close(final["weights"][name], trained[name], rtol=0, atol=0)


def test_hub_strategy_end_pushes_and_gathers_nothing_at_checkpoints(hub, tmp_path):
    """hub_strategy="end": the Trainer pushes nothing at a checkpoint, so the model is not gathered
    there either; `trainer.push_to_hub()` at the end saves and uploads it."""
    from transformers import AutoModelForCausalLM

    path = save_family("llama", tmp_path / "model")
    mesh = init_sequence_parallel()
    model = patch(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), mesh)
    out = str(tmp_path / "run")
    args = training_args(out, max_steps=1, save_strategy="steps", save_steps=1, push_to_hub=True,
                         hub_model_id="local/run", hub_strategy="end")
    trainer = LongContextTrainer(model=model, args=args, train_dataset=make_dataset(), mesh=mesh, max_tokens=48,
                                 tokens_per_step=120)
    trainer.train()
    assert hub.uploads == [] and "config.json" not in os.listdir(out)  # a checkpoint folder only
    trainer.push_to_hub()
    (final,) = hub.uploads
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(final["weights"][name], p.detach(), rtol=0, atol=0)


def _push_on_ranks(path: str, out: str) -> dict:
    """One pool rank (DP 2 x ring 2, FSDP2): train 2 steps with push_to_hub at every checkpoint,
    then `trainer.push_to_hub()`; what this rank uploaded, and the trained weights gathered."""
    import transformers
    import transformers.trainer
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from tests.helpers.pool import worker_mesh

    hub, saved = _Hub(), (transformers.trainer.hf_api, transformers.Trainer.create_model_card)
    transformers.trainer.hf_api = lambda: hub
    transformers.Trainer.create_model_card = lambda self, *a, **k: None
    try:
        mesh = worker_mesh(1, 2)
        model = patch(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), mesh)
        args = training_args(out, max_steps=2, save_strategy="steps", save_steps=1, push_to_hub=True,
                             hub_model_id="local/run", hub_strategy="checkpoint", warmup_steps=0)
        trainer = LongContextTrainer(model=model, args=args, train_dataset=make_dataset(), mesh=mesh, max_tokens=48,
                                     tokens_per_step=120)
        trainer.train()
        during = list(hub.uploads)
        hub.uploads.clear()
        trainer.push_to_hub()  # every rank calls it: the consolidated save is a collective
        trained = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                   for n, p in trainer.model.named_parameters()}
        return {"during": during, "final": list(hub.uploads), "trained": trained}
    finally:
        transformers.trainer.hf_api, transformers.Trainer.create_model_card = saved


def test_push_on_four_ranks_uploads_from_the_main_process_the_gathered_model(pools, tmp_path):
    """The same on 4 gloo ranks: only rank 0 uploads (2 checkpoints, each after its folder is
    complete, and the run's folder each time), every upload holds the whole trained model."""
    path = save_family("llama", tmp_path / "model")
    results = pools.get(4).run(_push_on_ranks, path, str(tmp_path / "run"), timeout=600)
    assert all(not r["during"] and not r["final"] for r in results[1:])  # the main process pushes alone
    main = results[0]
    checkpoints = [u for u in main["during"] if u["path_in_repo"] is not None]
    runs = [u for u in main["during"] if u["path_in_repo"] is None] + main["final"]
    assert len(checkpoints) == 2 and all(u["missing"] == [] for u in checkpoints), checkpoints
    assert len(runs) == 3
    for name, value in main["trained"].items():  # the last checkpoint's push and the end's: the trained weights
        for upload in runs[1:]:
            torch.testing.assert_close(upload["weights"][name], value, rtol=0, atol=0)
