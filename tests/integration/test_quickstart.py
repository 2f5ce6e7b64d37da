"""The README quickstart (`recipes/quickstart.py`) runs as written on 2 CPU ranks (torchrun,
gloo, Ulysses 2, FSDP2): a tiny local Llama + word-level tokenizer and three text files; it
must finish, log its loss, and leave a `save_pretrained` directory that loads unpatched."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quickstart_script_runs(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from tests.distributed.test_models import save_family
    from tests.distributed.test_trainer_sft import WORDS, make_tokenizer

    model_dir = save_family("llama", tmp_path)
    make_tokenizer(model_dir)  # the tokenizer files next to the model, as on the hub
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        words = [WORDS[j] for j in torch.randint(0, len(WORDS), (40 + 17 * i,), generator=g).tolist()]
        (tmp_path / f"doc{i}.txt").write_text(" ".join(words))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "recipes", "quickstart.py"), model_dir, str(tmp_path / "doc*.txt"), str(tmp_path / "out"), "2"]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "'loss'" in out and "'tokens_per_s'" in out, out[-2000:]
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert "hf_longctx" not in str(reloaded.config._attn_implementation)
