"""`hf_longctx.train` in one process (no FSDP to shard with): the loop must place the model
itself and honour a dataset's own `labels` column instead of training on every token."""

from __future__ import annotations

import pytest
import torch

from hf_longctx import init_sequence_parallel
from hf_longctx.training.loop import TrainConfig, train
from tests.distributed.test_models import save_family


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return save_family("llama", tmp_path_factory.mktemp("single"))


def _dataset(masked: bool):
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(6, 30, (12,), generator=g).tolist()
    ids = [torch.randint(1, 128, (n,), generator=g).tolist() for n in lengths]
    cols = {"input_ids": ids, "length": lengths}
    if masked:  # a prompt/response split: only the second half of each document is trained
        cols["labels"] = [[-100] * (len(x) // 2) + x[len(x) // 2 :] for x in ids]
    return Dataset.from_dict(cols)


def _train(path, dataset):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    before = [p.detach().clone() for p in model.parameters()]
    cfg = TrainConfig(steps=2, tokens_per_step=120, max_tokens=64, lr=1e-3, warmup_steps=0, mixed_precision="fp32",
                      progress_bar=False)
    res = train(model, dataset, init_sequence_parallel(), cfg)
    changed = any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    return res.losses, changed


def test_single_process_train_uses_labels_column(llama_path):
    plain, changed = _train(llama_path, _dataset(masked=False))
    assert changed and len(plain) == 2
    masked, _ = _train(llama_path, _dataset(masked=True))
    assert masked[0] != pytest.approx(plain[0], rel=1e-3)  # the prompt half is not in the loss


def test_param_offload_refused_in_one_process(llama_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    cfg = TrainConfig(steps=1, tokens_per_step=120, max_tokens=64, mixed_precision="fp32", param_offload=True,
                      progress_bar=False)
    with pytest.raises(ValueError, match="param_offload=True needs FSDP"):
        train(model, _dataset(masked=False), init_sequence_parallel(), cfg)
