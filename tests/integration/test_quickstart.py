"""The quickstart runs as pasted: its `bash` block is parsed out of docs/getting-started.md and
run line by line, unchanged, in a fresh directory (so page and test cannot drift). `recipes/` is
linked there and `.venv/bin/activate` puts the interpreter running this test first on PATH (the
environment `make demo` builds, whichever venv runs the suite). The tiny Llama, its tokenizer
and the text files are made locally by `recipes/tiny.py`; then 2 CPU ranks (torchrun, gloo,
Ulysses 2, FSDP2) train, log their loss as numbers, print no warning, and leave a
`save_pretrained` directory that loads unpatched. The page's script block is the script.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.helpers.doc_blocks import blocks_run_by

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


PAGE = "docs/getting-started.md"
HERE = "tests/integration/test_quickstart.py::"


def _quickstart_section() -> str:
    """The page's "Quickstart" / "With `transformers.Trainer`" subsection."""
    with open(os.path.join(ROOT, PAGE)) as f:
        page = f.read()
    start = page.index("### With `transformers.Trainer`", page.index("## Quickstart"))
    end = page.find("\n## ", start + 1)
    return page[start : end if end >= 0 else len(page)]


def readme_commands() -> list[str]:
    (block,) = blocks_run_by(PAGE, HERE + "test_quickstart_runs_as_pasted")
    assert block.lang == "bash", block
    return [line for line in block.text.splitlines() if line.strip()]


def test_page_script_block_is_the_script():
    (block,) = blocks_run_by(PAGE, HERE + "test_page_script_block_is_the_script")
    section = _quickstart_section()
    with open(os.path.join(ROOT, "recipes", "quickstart.py")) as f:
        script = f.read()
    assert block.text == script
    marks = script.count("# hf_longctx:")  # one per addition (the docstring names the mark without a colon)
    words = {3: "three", 4: "four", 5: "five", 6: "six"}
    assert f"plus {words[marks]} additions" in section and f"{words[marks]} additions" in script
    with open(os.path.join(ROOT, "recipes", "README.md")) as f:
        assert f"hf_longctx's {words[marks]} additions" in f.read()


def test_quickstart_runs_as_pasted(tmp_path):
    from transformers import AutoModelForCausalLM

    commands = readme_commands()
    assert any("recipes/quickstart.py" in c for c in commands), commands
    os.symlink(os.path.join(ROOT, "recipes"), tmp_path / "recipes")
    activate = tmp_path / ".venv" / "bin" / "activate"
    activate.parent.mkdir(parents=True)
    activate.write_text(f'export PATH="{os.path.dirname(sys.executable)}:$PATH"\n')
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    script = "set -e\n" + "\n".join(commands) + "\n"
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"'loss': \d+\.\d+, 'grad_norm': \d", out), out[-2000:]  # numbers, not quoted strings
    assert "'tokens_per_s': " in out and "'step_tokens': " in out, out[-2000:]
    assert not re.search(r"warn|error|traceback", out, re.I), out[-4000:]  # nothing the page does not explain
    bars = {name: len(re.findall(rf"{name}: +0%", out)) for name in ("Loading weights", "Map")}
    assert bars == {"Loading weights": 2, "Map": 1}, (bars, out[-4000:])  # weights: per process; tokenizing: once
    saved = tmp_path / "runs" / "quickstart"
    reloaded = AutoModelForCausalLM.from_pretrained(str(saved))
    assert "hf_longctx" not in str(reloaded.config._attn_implementation)
