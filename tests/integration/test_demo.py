"""The CPU demo end to end, as `make demo` runs it, at a reduced size (CI).

`accelerate launch` with accelerate_configs/cpu_4proc.yaml must start 4 gloo ranks (its
MULTI_CPU type would start one), the recipe must build its tokenizer and model locally,
load the model with `from_pretrained`, and train through `LongContextTrainer` (a
`transformers.Trainer`) with Ulysses 2 × ring 2 under FSDP2. The
loss must fall: from ln(1024) ≈ 6.93 (a fresh model over a 1024-id vocabulary) the first
optimizer steps on Python source cut it by >0.1 deterministically (seeded data, plan and
init); a broken gradient (wrong scale, no sync) leaves it flat or makes it rise.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.helpers.recipe_launch import recipe_modules


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 4


def test_demo_runs_end_to_end(tmp_path):
    accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or "accelerate"
    cmd = [
        accelerate, "launch", "--config_file", os.path.join(ROOT, "accelerate_configs", "cpu_4proc.yaml"),
        os.path.join(ROOT, "recipes", "demo.py"), "--steps", str(STEPS), "--files", "80", "--tokens-per-step", "3072",
        "--max-tokens", "1024", "--no-bar", "--output-dir", str(tmp_path), "--save-every", str(STEPS),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "4 rank(s) on cpu (gloo): dp 1 x ring 2 x ulysses 2" in out, out[-2000:]
    steps = re.findall(r"step +(\d+) \| loss ([\d.]+) .* \| ([\d.]+) tok/s \| plan synced/ideal ([\d.]+)", out)
    assert [int(s[0]) for s in steps] == list(range(1, STEPS + 1)), out[-2000:]
    losses = [float(s[1]) for s in steps]
    assert losses[-1] < losses[0] - 0.1, f"loss did not fall: {losses}"
    assert "summary: loss" in out and "wall time" in out
    ckpt = tmp_path / "checkpoints" / f"checkpoint-{STEPS}"
    assert (ckpt / "hf_longctx_dcp").is_dir() and (ckpt / "hf_longctx_sampler.json").exists()
    assert os.path.exists(tmp_path / "model" / "config.json")  # saved, then loaded with from_pretrained
    # What a newcomer reads: no special-token realignment notice (the model is built with the
    # tokenizer's ids), no weight bars for the tiny model, one tokenizing bar (rank 0's).
    assert "PAD/BOS/EOS" not in out and "Loading weights" not in out, out[-4000:]
    assert len(re.findall(r"Map: +0%", out)) == 1, out[-4000:]


def test_demo_defaults_say_nothing_about_their_own_settings(tmp_path):
    """The default corpus fits the default step budget (no warning about the demo's own
    tokens_per_step) and the model carries the tokenizer's special ids (the Trainer realigns
    nothing, so it prints no notice)."""
    import warnings

    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from transformers.trainer_utils import align_special_tokens

    demo, tiny = recipe_modules("demo", "tiny")
    from hf_longctx.training.sft.data import check_step_budget

    args = demo.parse_args([])
    texts = list(tiny.load_corpus(tiny.stdlib_files(args.files, 200, args.max_file_bytes))["text"])
    tiny.build_tokenizer(texts, args.vocab, str(tmp_path))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    lengths = [len(ids) + 1 for ids in tokenizer(texts)["input_ids"]]  # + EOS, as tokenize_dataset adds it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_step_budget(lengths, args.tokens_per_step, args.max_tokens, "split")
    tiny.build_model(tokenizer, str(tmp_path / "model"), hidden=16, layers=1)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    before = (model.config.eos_token_id, model.config.pad_token_id, model.generation_config.eos_token_id)
    align_special_tokens(model, tokenizer)
    assert (model.config.eos_token_id, model.config.pad_token_id, model.generation_config.eos_token_id) == before



@pytest.mark.parametrize("unequal", [False, True], ids=["equal-calls", "unequal-calls"])
def test_demo_flex_runs_end_to_end(tmp_path, unequal):
    """`--flex` (`make demo DEMO_ARGS="--flex"`): the trainer's mesh is a group bank of sizes 1,
    2, 4; every step is planned with `plan_flexible` and logs its slot layouts. Same loss
    criterion as above (the run is exact, so it learns like the fixed-mesh run). With
    `--unequal-calls` the steps are planned with `plan_unequal` (slots need not tile the
    ranks) and run with the model unsharded for the step."""
    accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or "accelerate"
    cmd = [
        accelerate, "launch", "--config_file", os.path.join(ROOT, "accelerate_configs", "cpu_4proc.yaml"),
        os.path.join(ROOT, "recipes", "demo.py"), "--flex", "--steps", str(STEPS), "--files", "80",
        "--tokens-per-step", "3072", "--max-tokens", "1024", "--no-bar", "--output-dir", str(tmp_path),
        *(["--unequal-calls"] if unequal else []),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "flexible SP groups of sizes 1 (ulysses 1 x ring 1), 2 (ulysses 2 x ring 1), 4 (ulysses 2 x ring 2)" in out, out[-2000:]
    steps = re.findall(r"step +(\d+) \| loss ([\d.]+) .* \| slots ((?:\[[\d+]+\] ?)+) \| busy max/mean ([\d.]+)", out)
    assert [int(s[0]) for s in steps] == list(range(1, STEPS + 1)), out[-2000:]
    losses = [float(s[1]) for s in steps]
    assert losses[-1] < losses[0] - 0.1, f"loss did not fall: {losses}"
    for _, _, slots, busy in steps:  # every slot tiles the 4 ranks (equal calls); busy max/mean >= 1 by definition
        covered = [sum(int(x) for x in slot.strip("[]").split("+")) for slot in slots.split()]
        assert all(c <= 4 for c in covered) and (unequal or all(c == 4 for c in covered)), slots
        assert float(busy) >= 1.0
