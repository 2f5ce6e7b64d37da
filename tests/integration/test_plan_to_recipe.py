"""`hf-longctx plan`'s suggestion is applicable: its "as recipe flags" line pastes into
`recipes/pretrain.py` and trains (at a small scale on CPU).

The plan is made for the tiny test Llama on 2 "GPUs" with 600 KiB each, so that only FPDT
chunks with K/V offload and checkpointing (preset "high": keep-attention, the faster of the two
checkpointing presets, fits since FPDT's offload already parks the attention's tensors) and
parameter offload fit -- the settings with the most moving parts; the printed flags are then appended verbatim to a `torchrun --nproc-per-node 2`
launch of the pretraining recipe (gloo, FSDP2 with CPUOffloadPolicy) on three word documents,
which must finish its steps with a finite loss. The same flags parse in `recipes/sft.py` and
`recipes/demo.py` (one shared option set, `recipes/common.py`)."""

from __future__ import annotations

import math
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.helpers.recipe_launch import recipe_modules

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _suggested_flags(config: str, capsys, gpus: int = 2, gpu_memory: str = "600KiB") -> list[str]:
    from hf_longctx.cli import main

    assert main(["plan", "--model", config, "--gpus", str(gpus), "--gpu-memory", gpu_memory, "--host-memory", "1GiB",
                 "--seq-len", "256", "--tokens-per-step", "512", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    line = out.split("as recipe flags (recipes/pretrain.py, lora.py, sft.py):\n", 1)[1].splitlines()[0]
    return shlex.split(line)


def test_suggested_recipe_flags_train_on_2_gloo_ranks(tmp_path, capsys):
    import torch

    from tests.helpers.families import save_family
    from tests.helpers.word_tokenizer import WORDS, make_tokenizer

    model_dir = save_family("llama", tmp_path)
    make_tokenizer(model_dir)
    flags = _suggested_flags(os.path.join(model_dir, "config.json"), capsys)
    text = " ".join(flags)
    assert "--memory high" in text and "--param-offload" in text and "--fpdt-chunks 2" in text, text
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        words = [WORDS[j] for j in torch.randint(0, len(WORDS), (150 + 40 * i,), generator=g).tolist()]
        (tmp_path / f"doc{i}.txt").write_text(" ".join(words))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "recipes", "pretrain.py"), "--model", model_dir, "--dataset", "text",
           "--data-files", str(tmp_path / "doc0.txt"), str(tmp_path / "doc1.txt"), str(tmp_path / "doc2.txt"),
           "--sample-by", "document", "--steps", "2", "--output-dir", str(tmp_path / "out"), "--save-every", "100",
           *flags]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "2 rank(s) on cpu (gloo)" in out and "ulysses 2" in out, out[-2000:]
    losses = [float(x) for x in re.findall(r"'loss': '?([\d.]+)", out)]
    assert len(losses) >= 2 and all(math.isfinite(x) for x in losses), out[-2000:]


@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_one_gpu_plan_offloads_in_one_process(tmp_path, capsys, launcher):
    """`hf-longctx plan --gpus 1` (750 KiB: only parameter offload with FPDT fits) pasted into a
    one-process pretraining run, started without a launcher (the library creates the one-rank
    process group FSDP2 needs) or by `torchrun --nproc-per-node 1` (Accelerate's group): FSDP2
    over one rank keeps the parameters in host memory (the run says so; the memory itself is
    measured in tests/distributed/test_trainer.py), and no DDP is built around the model (its
    `find_unused_parameters` warning would name it)."""
    import torch

    from tests.helpers.families import save_family
    from tests.helpers.word_tokenizer import WORDS, make_tokenizer

    model_dir = save_family("llama", tmp_path)
    make_tokenizer(model_dir)
    flags = _suggested_flags(os.path.join(model_dir, "config.json"), capsys, gpus=1, gpu_memory="750KiB")
    assert "--param-offload" in flags, flags
    g = torch.Generator().manual_seed(0)
    words = [WORDS[j] for j in torch.randint(0, len(WORDS), (300,), generator=g).tolist()]
    (tmp_path / "doc.txt").write_text(" ".join(words))
    start = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
                                if launcher == "torchrun" else [])
    cmd = [*start, os.path.join(ROOT, "recipes", "pretrain.py"), "--model", model_dir, "--dataset", "text",
           "--data-files", str(tmp_path / "doc.txt"), "--sample-by", "document", "--steps", "2",
           "--output-dir", str(tmp_path / "out"), "--save-every", "100", *flags]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "find_unused_parameters" not in out and "DistributedDataParallel" not in out, out[-2000:]
    assert "FSDP2 shards over all 1; parameters, gradients and optimizer states in host memory" in out, out[-2000:]
    losses = [float(x) for x in re.findall(r"'loss': '?([\d.]+)", out)]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), out[-2000:]


def test_the_same_flags_parse_in_every_recipe(tmp_path, capsys):
    demo, pretrain, sft = recipe_modules("demo", "pretrain", "sft")
    from tests.helpers.families import save_family

    flags = _suggested_flags(os.path.join(save_family("llama", tmp_path), "config.json"), capsys)
    common = {"ulysses": 2, "ring": 1, "fpdt_chunks": 2, "memory": "high", "param_offload": True,
              "mixed_precision": "fp32", "max_tokens": 256, "tokens_per_step": 512}
    req = ["--model", "m", "--dataset", "json", "--steps", "1", "--output-dir", "o"]
    parsed = [pretrain.parse_args(pretrain.build_parser("pretrain"), req + flags), sft.parse_args(req + flags),
              demo.parse_args(flags)]
    for args in parsed:
        assert {k: getattr(args, k) for k in common} == common
        assert args.sync_each_microbatch is False and args.resume is False and args.tokenizer is None
