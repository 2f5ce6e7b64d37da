"""The Python blocks of README.md and the guides that run in one process, run as written.

Each block is parsed from its page (`tests/helpers/doc_blocks.py`) and executed on a tiny
Llama saved with `save_pretrained`, on a one-process mesh (`WORLD_SIZE` unset): the README's
path from `from_pretrained` to one trained step (docs/guides' blocks too: the memory presets of
docs/guides/memory.md, the LoRA adapter of docs/guides/lora.md, materialising a meta-device
model in docs/guides/own-loop.md). What each block claims is checked after it ran: a step
logged a finite loss, the preset's options are the patched model's, only the adapter trains,
the materialised model equals `from_pretrained`'s and a trainer accepts it."""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.helpers.doc_blocks import blocks_run_by
from tests.helpers.families import save_family
from tests.helpers.trainer_cases import make_dataset, training_args

HERE = "tests/integration/test_docs_snippets.py::"


@pytest.fixture(scope="module")
def model_id(tmp_path_factory):
    return save_family("llama", tmp_path_factory.mktemp("docs_snippets"))


def _run(page: str, test: str, scope: dict) -> dict:
    import hf_longctx
    from transformers import AutoModelForCausalLM

    (block,) = blocks_run_by(page, HERE + test)
    scope = {"os": os, "hf_longctx": hf_longctx, "AutoModelForCausalLM": AutoModelForCausalLM, **scope}
    exec(compile(block.text, f"{page}:{block.line}", "exec"), scope)
    return scope


def test_readme_from_pretrained_to_training(model_id, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = training_args(str(tmp_path), max_steps=1)
    scope = _run("README.md", "test_readme_from_pretrained_to_training",
                 {"model_id": model_id, "args": args, "docs": make_dataset()})
    logged = [h["loss"] for h in scope["trainer"].state.log_history if "loss" in h]
    assert logged and math.isfinite(logged[0]), scope["trainer"].state.log_history


def test_memory_presets_block(model_id):
    """Each line of the block re-patches the model with its preset; after each, the model's
    options are that preset's (chunked loss from "balanced" on, checkpointing from "high")."""
    from hf_longctx import init_sequence_parallel, patch
    from hf_longctx.integrations.patch_state import STATE_ATTR
    from transformers import AutoModelForCausalLM

    (block,) = blocks_run_by("docs/guides/memory.md", HERE + "test_memory_presets_block")
    model = AutoModelForCausalLM.from_pretrained(model_id, dtype=torch.float32)
    scope = {"patch": patch, "model": model, "mesh": init_sequence_parallel()}
    seen = {}
    for line in [x for x in block.text.splitlines() if x.strip()]:
        exec(line, scope)
        options = model.__dict__[STATE_ATTR].options
        seen[line.split('memory="')[1].split('"')[0]] = (options.loss_chunks not in (None, 1), options.checkpoint)
    assert seen == {"balanced": (True, False), "high": (True, "attention"), "max": (True, True)}, seen


def test_lora_block(model_id, monkeypatch):
    pytest.importorskip("peft")
    from hf_longctx import is_patched

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = _run("docs/guides/lora.md", "test_lora_block", {"model_id": model_id})["model"]
    assert is_patched(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable), trainable


def test_meta_model_block(model_id, tmp_path, monkeypatch):
    """The meta-device recipe of the own-loop guide: after it, no tensor is on meta, every
    parameter and buffer (RoPE's inv_freq included) equals `from_pretrained`'s, and the trainer
    accepts the model (the meta model itself is refused: tests/integration/test_bad_inputs.py)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_longctx import LongContextTrainer, init_sequence_parallel

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    mesh = init_sequence_parallel()
    scope = _run("docs/guides/own-loop.md", "test_meta_model_block",
                 {"torch": torch, "config": AutoConfig.from_pretrained(model_id), "path": model_id, "mesh": mesh})
    model = scope["model"]
    loaded = AutoModelForCausalLM.from_pretrained(model_id, dtype=torch.float32)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    mine = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, ref in [*loaded.named_parameters(), *loaded.named_buffers()]:
        torch.testing.assert_close(mine[name], ref, rtol=0, atol=0, msg=name)
    LongContextTrainer(model=model, args=training_args(str(tmp_path)), train_dataset=make_dataset(), mesh=mesh,
                       max_tokens=48, tokens_per_step=120)

