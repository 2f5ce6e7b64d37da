"""`LongContextTrainer` in one process, and every refusal (raised before any collective).

One process: the trainer places the model itself (no FSDP to shard with) and honours a
dataset's own `labels` column: with the first third of every other document masked, the
logged loss is the mean over the remaining targets only -- checked against the loss the
unpatched model computes on the same documents by hand (no trainer involved).
"""

from __future__ import annotations

import os

import pytest
import torch

from hf_longctx import LongContextTrainer, init_sequence_parallel, patch
from tests.helpers.families import save_family
from tests.helpers.trainer_cases import make_dataset, training_args


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return save_family("llama", tmp_path_factory.mktemp("single"))


def _model(path, mesh=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return patch(model, mesh) if mesh is not None else model


def _reference_first_loss(path, ds, trainer) -> float:
    """Mean token loss of the first step's documents, unpatched model, per document, HF shift."""
    sampler_steps = trainer.step_sampler.epoch_steps(0)
    model = _model(path)
    total, count = 0.0, 0
    for i in sampler_steps[0].tolist():
        row = ds[i]
        ids = torch.tensor([row["input_ids"]])
        labels = torch.tensor([row.get("labels") or row["input_ids"]])
        logits = model(input_ids=ids, use_cache=False).logits.double()
        tgt = labels[:, 1:]
        lp = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                                               ignore_index=-100, reduction="sum")
        total += float(lp)
        count += int((tgt != -100).sum())
    return total / count


@pytest.mark.parametrize("masked", [False, True])
def test_single_process_loss_is_the_token_mean_over_labels(llama_path, tmp_path, masked):
    mesh = init_sequence_parallel()
    ds = make_dataset(masked=masked)
    trainer = LongContextTrainer(model=_model(llama_path, mesh), args=training_args(str(tmp_path), max_steps=1),
                                 train_dataset=ds, mesh=mesh, max_tokens=48, tokens_per_step=120)
    trainer.train()
    logged = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    assert logged == pytest.approx(_reference_first_loss(llama_path, ds, trainer), rel=1e-5)


REFUSED = {
    "gradient_accumulation_steps": (dict(gradient_accumulation_steps=2), "gradient_accumulation_steps=2"),
    "label_smoothing": (dict(label_smoothing_factor=0.1), "label_smoothing_factor"),
    "liger": (dict(use_liger_kernel=True), "use_liger_kernel"),
    "sampling": (dict(train_sampling_strategy="group_by_length"), "train_sampling_strategy"),
    "batch_size": (dict(per_device_train_batch_size=2), "per_device_train_batch_size=2"),
    "workers": (dict(dataloader_num_workers=2), "dataloader_num_workers=2"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_training_arguments(llama_path, tmp_path, name):
    kw, match = REFUSED[name]
    mesh = init_sequence_parallel()
    with pytest.raises(ValueError, match=match):
        LongContextTrainer(model=_model(llama_path, mesh), args=training_args(str(tmp_path), **kw),
                           train_dataset=make_dataset(), mesh=mesh, max_tokens=48, tokens_per_step=120)


def test_parallelism_config_in_one_process(llama_path, tmp_path, monkeypatch):
    """Without mesh=, the trainer builds the mesh a ParallelismConfig maps to and patches the
    model; in one process that is the mesh of 1 (an SP degree above 1 is refused by field). The
    launcher's variables are read the same way and hidden from the Trainer's Accelerator."""
    from accelerate import ParallelismConfig

    from hf_longctx import NotSupported, is_patched

    kw = dict(train_dataset=make_dataset(), max_tokens=48, tokens_per_step=120)
    model = _model(llama_path)
    trainer = LongContextTrainer(model=model, args=training_args(str(tmp_path), max_steps=1,
                                                                 parallelism_config=ParallelismConfig()), **kw)
    assert is_patched(model) and trainer.mesh.world_size == 1 and trainer.accelerator.parallelism_config is None
    trainer.train()
    with pytest.raises(NotSupported, match=r"sp_size\(2\) does not divide world size 1; do instead: launch a multiple of 2 processes"):
        LongContextTrainer(model=_model(llama_path), args=training_args(
            str(tmp_path), parallelism_config=ParallelismConfig(sp_size=2)), **kw)
    with pytest.raises(NotSupported, match="got no mesh: neither mesh= nor a ParallelismConfig"):
        LongContextTrainer(model=_model(llama_path), args=training_args(str(tmp_path)), **kw)
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")  # as `accelerate launch` exports it
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "1")
    trainer = LongContextTrainer(model=_model(llama_path), args=training_args(str(tmp_path)), **kw)
    assert trainer.accelerator.parallelism_config is None and trainer.mesh.world_size == 1
    assert os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"  # restored after the Accelerator was built
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # --use_fsdp, which --use_parallelism_config requires
    with pytest.raises(NotSupported, match="ACCELERATE_USE_FSDP=true") as info:
        LongContextTrainer(model=_model(llama_path), args=training_args(str(tmp_path)), **kw)
    assert "distributed_type: MULTI_GPU" in str(info.value)


def test_refused_models_and_data(llama_path, tmp_path):
    from datasets import Dataset

    mesh = init_sequence_parallel()
    args = training_args(str(tmp_path))
    kw = dict(mesh=mesh, max_tokens=48, tokens_per_step=120)
    with pytest.raises(ValueError, match="is not patched"):
        LongContextTrainer(model=_model(llama_path), args=args, train_dataset=make_dataset(), **kw)
    with pytest.raises(ValueError, match="no 'input_ids' column"):
        LongContextTrainer(model=_model(llama_path, mesh), args=args, train_dataset=Dataset.from_dict({"text": ["a b"]}), **kw)
    with pytest.raises(ValueError, match=r"exceed max_tokens=16 \(document 0 has 30 tokens"):
        LongContextTrainer(model=_model(llama_path, mesh), args=args, tokens_per_step=120, mesh=mesh, max_tokens=16,
                           train_dataset=Dataset.from_dict({"input_ids": [list(range(1, 31))]}))
    with pytest.raises(ValueError, match="compute_metrics is not supported"):
        LongContextTrainer(model=_model(llama_path, mesh), args=args, train_dataset=make_dataset(),
                           compute_metrics=lambda p: {}, **kw)


def test_activation_checkpointing_maps_to_patch_checkpoint(llama_path, tmp_path):
    from transformers import TrainingArguments

    from hf_longctx._compat import checkpointing_fields
    from hf_longctx.integrations.patch_state import STATE_ATTR

    mesh = init_sequence_parallel()
    field = checkpointing_fields(TrainingArguments)[0]  # activation_checkpointing; 5.17: gradient_checkpointing
    args = training_args(str(tmp_path), **{field: True})
    model = _model(llama_path, mesh)
    trainer = LongContextTrainer(model=model, args=args, train_dataset=make_dataset(), mesh=mesh, max_tokens=48,
                                 tokens_per_step=120)
    assert model.__dict__[STATE_ATTR].options.checkpoint is True  # recomputation inside our attention binding
    assert not any(getattr(trainer.args, f) for f in checkpointing_fields(args))  # HF's own wrapper stays off
    assert getattr(args, field) is True and trainer.args is not args  # the user's object is not rewritten


def test_no_clipping_still_logs_the_summed_gradient_norm(llama_path, tmp_path, monkeypatch):
    """max_grad_norm=0 (no clipping) reaches the Trainer as inf: every step's norm is the base's
    (`summed_grad_norm` with inf, the one path under comm_guard), logged, and the steps equal a
    run whose bound (1e9) never clips; the user's arguments keep 0."""
    from hf_longctx.training.base import trainer as base

    calls = []
    norm = base.summed_grad_norm
    monkeypatch.setattr(base, "summed_grad_norm", lambda model, max_norm, step: calls.append(max_norm) or norm(
        model, max_norm, step))
    logs = {}
    for bound in (0.0, 1e9):
        mesh = init_sequence_parallel()
        args = training_args(str(tmp_path / str(bound)), max_steps=2, max_grad_norm=bound)
        trainer = LongContextTrainer(model=_model(llama_path, mesh), args=args, train_dataset=make_dataset(), mesh=mesh,
                                     max_tokens=48, tokens_per_step=120)
        trainer.train()
        assert args.max_grad_norm == bound and trainer.args.max_grad_norm == (bound or float("inf"))
        logs[bound] = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]
    assert calls == [float("inf")] * 2 + [1e9] * 2  # one norm per step, ours, in both runs
    assert len(logs[0.0]) == 2 and all(g > 0 for _, g in logs[0.0]) and logs[0.0] == logs[1e9]


def test_trainer_steps_equal_with_keep_attention_full_and_no_checkpoint(llama_path, tmp_path):
    """Three optimizer steps of LongContextTrainer with the model patched checkpoint=False,
    True and "attention": the logged loss and grad_norm of every step are equal (fp32: the
    same kernels on the same inputs, only autograd's summation order may differ, ~1e-7)."""
    from hf_longctx.integrations.model_patch import patch_state
    from tests.helpers.trainer_cases import history

    mesh = init_sequence_parallel()
    runs = {}
    for mode in (False, True, "attention"):
        model = patch(_model(llama_path), mesh, checkpoint=mode)
        trainer = LongContextTrainer(model=model, args=training_args(str(tmp_path / str(mode))), mesh=mesh,
                                     train_dataset=make_dataset(), max_tokens=48, tokens_per_step=120)
        trainer.train()
        runs[mode] = history(trainer)
        if mode == "attention":
            assert patch_state(model).keeper.replayed > 0  # the recompute replayed the attention
    assert len(runs[False]) == 3
    for mode in (True, "attention"):
        for (loss, norm), (loss_ref, norm_ref) in zip(runs[mode], runs[False]):
            assert abs(loss - loss_ref) <= 1e-6 * abs(loss_ref) and abs(norm - norm_ref) <= 1e-5 * abs(norm_ref), (mode, runs)


def test_logged_numbers_print_as_numbers(llama_path, tmp_path, capsys):
    """The Trainer's printer (and progress bar) show each logged value as a number, not a quoted
    string; what reaches log_history is unchanged."""
    from hf_longctx.training.base.log_lines import format_logs

    mesh = init_sequence_parallel()
    trainer = LongContextTrainer(model=_model(llama_path, mesh), args=training_args(str(tmp_path), max_steps=1),
                                 train_dataset=make_dataset(), mesh=mesh, max_tokens=48, tokens_per_step=120)
    trainer.train()
    printed = [line for line in capsys.readouterr().out.splitlines() if "'loss'" in line]
    assert printed and "'loss': '" not in printed[0] and "'tokens_per_s': '" not in printed[0], printed
    loss = trainer.state.log_history[0]["loss"]
    assert f"'loss': {loss:.4g}" in printed[0], printed
    assert format_logs({"a": 63382.0, "b": 3e-05, "c": 7, "d": "[4] [2+2]", "e": 3463.2, "total_flos": 1.0}) == (
        "{'a': 63382, 'b': 3e-05, 'c': 7, 'd': '[4] [2+2]', 'e': 3463}")


class _ModeSGD(torch.optim.SGD):
    """SGD with a schedule-free optimizer's train/eval modes: `step` only in train mode (as
    schedulefree's optimizers raise), and `Trainer.evaluate` switches it to eval mode."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.modes: list[str] = []
        self.training = True

    def train(self):
        self.modes.append("train")
        self.training = True

    def eval(self):
        self.modes.append("eval")
        self.training = False

    def step(self, closure=None):
        if not self.training:
            raise RuntimeError("optimizer.step() in eval mode: the training step did not call optimizer.train()")
        return super().step(closure)


def test_schedule_free_optimizer_is_back_in_train_mode_after_evaluation(llama_path, tmp_path):
    """An optimizer with train/eval modes is switched as the Trainer's own loops switch it:
    evaluation between two steps puts it in eval mode, the next training step back in train mode."""
    mesh = init_sequence_parallel()
    args = training_args(str(tmp_path), max_steps=2, eval_strategy="steps", eval_steps=1)
    trainer = LongContextTrainer(model=_model(llama_path, mesh), args=args, train_dataset=make_dataset(),
                                 eval_dataset=make_dataset(6, seed=1), mesh=mesh, max_tokens=48, tokens_per_step=120,
                                 optimizer_cls_and_kwargs=(_ModeSGD, {"lr": 1e-3}))
    trainer.train()
    modes = trainer.optimizer.optimizer.modes if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer.modes
    assert modes[:3] == ["train", "eval", "train"], modes  # step 1, evaluation, step 2


def test_lomo_gets_the_learning_rate_in_the_backward(llama_path, tmp_path):
    """optim="lomo" / "adalomo" update inside the backward: the training step passes the current
    learning rate to `accelerator.backward`, as Trainer.training_step does (recorded here; the
    optimizer is plain SGD, lomo_optim is not needed)."""
    mesh = init_sequence_parallel()
    args = training_args(str(tmp_path), max_steps=1, optim="lomo", learning_rate=0.25, lr_scheduler_type="constant",
                         warmup_steps=0)
    trainer = LongContextTrainer(model=_model(llama_path, mesh), args=args, train_dataset=make_dataset(), mesh=mesh,
                                 max_tokens=48, tokens_per_step=120, optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.25}))
    seen = []

    def backward(loss, **kwargs):
        seen.append(kwargs)
        loss.backward()

    trainer.accelerator.backward = backward
    trainer.train()
    assert seen and all(kw == {"learning_rate": 0.25} for kw in seen), seen


def _padded(ds, side: str, width: int = 40, pad: int = 0):
    """`ds`'s rows padded to `width` at `side` as `tokenizer(..., padding="max_length")` pads them,
    with the `attention_mask` column; the labels are padded with the pad id (a target, were the
    pads trained)."""
    from datasets import Dataset

    def padded(row: list[int], n: int) -> list[int]:
        return row + [pad] * n if side == "right" else [pad] * n + row

    cols = {k: [padded(r, width - len(r)) for r in ds[k]] for k in ds.column_names}
    cols["attention_mask"] = [padded([1] * len(r), width - len(r)) for r in ds["input_ids"]]
    return Dataset.from_dict(cols)


def test_padded_rows_train_as_the_unpadded_rows(llama_path, tmp_path):
    """A dataset padded to 40 tokens per row with its `attention_mask` (right or left padding, labels
    padded with the pad id): only the mask-1 tokens become documents, so the step draws the same
    documents, plans the same tokens (`step_tokens`) and logs the same loss and gradient norm as
    the unpadded dataset (fp32, one process: the same kernels on the same packed rows)."""
    from tests.helpers.trainer_cases import history

    mesh = init_sequence_parallel()
    logs = {}
    for name in ("unpadded", "right", "left"):
        ds = make_dataset(masked=True)
        trainer = LongContextTrainer(model=_model(llama_path, mesh), args=training_args(str(tmp_path), max_steps=1),
                                     train_dataset=ds if name == "unpadded" else _padded(ds, name), mesh=mesh,
                                     max_tokens=48, tokens_per_step=120)
        trainer.train()
        logs[name] = ([h["step_tokens"] for h in trainer.state.log_history if "loss" in h], history(trainer))
    assert max(logs["unpadded"][0]) < 120, logs  # 3 rows of 40 would be 120
    for side in ("right", "left"):
        assert logs[side][0] == logs["unpadded"][0], logs
        for (loss, norm), (ref_loss, ref_norm) in zip(logs[side][1], logs["unpadded"][1]):
            assert loss == pytest.approx(ref_loss, rel=1e-6) and norm == pytest.approx(ref_norm, rel=1e-5), logs
