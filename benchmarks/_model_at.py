"""The step-time model of the code a GPU run measured: that commit's ops, today's seconds.

Where it sits: under `benchmarks/gpu_backtest.py` and `gpu_derive.py`. A run measured the code
at one commit; the ops its steps ran are what that commit's `capacity/inventory.py` says (with
its `module_ops.py`, `step_time.shape_of` and the chunk rules of its `ops/tiling.py`), not what
the inventory of the code as it is says. `model_at` takes that commit's `hf_longctx` out of git
(`git archive`) into a temporary directory, puts the working tree's seconds side into it
(`capacity/gpus.py` and `capacity/roofline.py`: the constants and overlaps under test) and
evaluates the rows in a child interpreter that imports only that tree. Guarantees: a row is
timed by that commit's inventory or comes back with an error naming why (no git history, an
unknown commit, a preset that code did not have), never by today's inventory in disguise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECONDS_SIDE = ("hf_longctx/capacity/gpus.py", "hf_longctx/capacity/roofline.py")


class ModelUnavailable(RuntimeError):
    """The model of a commit cannot be evaluated here (no git history, unknown commit)."""


def widths(shape: str, layers: int) -> dict:
    """The LlamaConfig fields of benchmarks/gpu_throughput.py's `shape` with `layers` layers."""
    from benchmarks.gpu_throughput import SHAPES

    hidden, inter, heads, kv, head_dim, vocab, tied, _ = SHAPES[shape]
    return dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=head_dim, vocab_size=vocab, tie_word_embeddings=tied,
                max_position_embeddings=1 << 22, rope_theta=500000.0)


def model_at(commit: str, rows: list[dict], want: str = "time", timeout: float = 600.0) -> list[dict]:
    """Per row ({card, shape, layers, preset, tokens}), the commit's model: want="time" gives
    the Breakdown's fields (seconds, attention, gemm, hbm, launches, links, kernels, binds,
    model_flops); want="ops" gives the step's ops outside the layers and one layer's, as dicts.
    A row the commit cannot model has {"error": why}. Raises ModelUnavailable when git cannot
    give the commit's tree."""
    if shutil.which("git") is None:
        raise ModelUnavailable("git is not installed")
    with tempfile.TemporaryDirectory(prefix="model_at_") as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit, "hf_longctx"],
                                 capture_output=True, timeout=timeout)
        if archive.returncode != 0:
            raise ModelUnavailable(f"git archive {commit}: {archive.stderr.decode(errors='replace').strip()[-300:]}")
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True, timeout=timeout)
        for path in SECONDS_SIDE:
            shutil.copyfile(ROOT / path, Path(tmp) / path)
        spec = [dict(r, config=widths(r["shape"], r["layers"])) for r in rows]
        env = dict(os.environ, PYTHONPATH=tmp)
        child = subprocess.run([sys.executable, "-I", __file__, want], input=json.dumps(spec),
                               capture_output=True, text=True, env=env, cwd=tmp, timeout=timeout)
        if child.returncode != 0:
            raise ModelUnavailable(f"the model of {commit} failed: {child.stderr.strip()[-800:]}")
        return json.loads(child.stdout)


def _child(want: str, spec: list[dict]) -> list[dict]:
    """In the child: evaluate every row with the tree on PYTHONPATH (see `model_at`)."""
    import dataclasses

    from transformers import LlamaConfig

    from hf_longctx.capacity.cluster import Cluster
    from hf_longctx.capacity.estimate import ModelDims
    from hf_longctx.capacity.inventory import layer_ops, step_ops
    from hf_longctx.capacity.search import preset_setting
    from hf_longctx.capacity.step_time import shape_of, step_time

    out = []
    for r in spec:
        try:
            dims = ModelDims.from_config(LlamaConfig(**r["config"]))
            preset, _, extra = r["preset"].partition("+")
            s = preset_setting(1, 1, 1, preset, dims)
            if extra:
                if extra != "keep" or "keep_attention" not in {f.name for f in dataclasses.fields(s)}:
                    raise ValueError(f"preset {r['preset']!r}: this code has no such setting")
                s = dataclasses.replace(s, keep_attention=True)
            if want == "ops":
                sh = shape_of(dims, s, r["tokens"])
                out.append({"step": [_op(o) for o in step_ops(sh)], "layer": [_op(o) for o in layer_ops(sh)]})
                continue
            b = step_time(dims, s, Cluster(1, 141e9, 2e12, gpu=r["card"]), r["tokens"])
            out.append({"seconds": b.seconds, "attention": b.attention, "gemm": b.flops - b.attention, "hbm": b.hbm,
                        "launches": b.launches, "links": b.links, "kernels": b.kernels, "binds": b.binds,
                        "model_flops": b.model_flops})
        except Exception as e:  # noqa: BLE001 -- one row this code cannot model; the others stand
            out.append({"error": f"{type(e).__name__}: {e}"})
    return out


def _op(o) -> dict:
    return {"kind": o.kind, "flops": o.flops, "bytes": o.bytes, "count": o.count, "what": o.what, "stream": o.stream}


if __name__ == "__main__":
    # -I isolates the child from the parent's site and path: only PYTHONPATH's tree is importable,
    # besides the interpreter's installed packages (torch, transformers).
    sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    print(json.dumps(_child(sys.argv[1], json.loads(sys.stdin.read()))))
