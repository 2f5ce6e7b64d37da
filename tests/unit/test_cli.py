"""`hf-longctx plan` on a known config: table columns, exclusion of infeasible settings,
best-first order, the message when nothing fits, and the --plot figure."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from hf_longctx.cli import main
from hf_longctx.cli.capacity import HEADER
from hf_longctx.cli.inputs import parse_size
from hf_longctx.capacity.estimate import ModelDims, Setting, estimate_memory

# Llama-style, 8 query / 2 KV heads: ulysses 16 cannot split the 8 heads.
CONFIG = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
          "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 32000, "max_position_embeddings": 1 << 20}
BASE = ["plan", "--gpus", "16", "--gpu-memory", "3GiB", "--host-memory", "64GiB", "--seq-len", "65536"]


@pytest.fixture
def config_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    return path


def _table(out: str) -> list[dict[str, str]]:
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert cells[0] == HEADER
    return [dict(zip(HEADER, row)) for row in cells[1:]]


def _setting(row: dict[str, str]) -> Setting:
    """The memory-model Setting a table row stands for ("auto" MLP chunks: from the model's sizes)."""
    from hf_longctx.ops.tiling import default_mlp_chunks

    chunked = row["chunked mlp/loss"].startswith("yes")
    rows = row["chunked mlp/loss"].removeprefix("yes (loss rows ").removesuffix(")") if chunked else ""
    return Setting(
        ulysses=int(row["ulysses"]), ring=int(row["ring"]), fpdt_chunks=int(row["fpdt"]),
        kv_offload=row["kv offload"] == "yes", checkpoint={"full": True, "keep attn": "attention"}.get(row["ckpt"], False),
        mlp_chunks=default_mlp_chunks(int(row["fpdt"]), CONFIG["intermediate_size"], CONFIG["hidden_size"]) if chunked else 1,
        loss_chunks=0 if chunked else 1, param_offload=row["param offload"] == "yes",
        loss_chunk_rows=int(rows) if rows.isdigit() else 0,
    )


def test_plan_table_is_feasible_and_best_first(config_path, capsys):
    assert main([*BASE, "--model", str(config_path), "--top", "100"]) == 0
    out = capsys.readouterr().out
    rows = _table(out)
    assert rows and all(r["fits"] == "yes" for r in rows)
    assert all(float(r["peak GiB"]) <= 0.9 * 3 for r in rows)  # 10 % headroom by default
    speed = [float(r["tok/s/GPU"].replace(",", "")) for r in rows]
    # Near ties (within 7 % of the fastest) first, the USP-guided ones (Ulysses as wide as a node of 8 and
    # the 8 heads allow, ring only across nodes) before the others; then strictly by speed.
    band = [i for i, v in enumerate(speed) if v >= 0.93 * max(speed)]
    assert band == list(range(len(band))) and speed[len(band):] == sorted(speed[len(band):], reverse=True)
    sp = [int(rows[i]["ulysses"]) * int(rows[i]["ring"]) for i in band]
    guided = [int(rows[i]["ulysses"]) == min(n, 8) for i, n in zip(band, sp)]
    assert guided == sorted(guided, reverse=True)
    assert {r["ulysses"] for r in rows} <= {"1", "2", "4", "8"}  # 8 heads: never ulysses 16
    assert all(r["fpdt"] == "1" or r["ring"] == "1" for r in rows)
    assert all(r["kv offload"] == "no" or r["fpdt"] != "1" for r in rows)
    assert "infeasible not shown" in out and "Assumptions" in out and "by the step-time model" in out
    assert all(0 < float(r["MFU %"]) < 100 and r["binds"] for r in rows)  # modelled, never an input
    # The plain setting (memory="off") at sp 1 holds 64K tokens of 32K-vocab logits: far over 3 GiB.
    assert not any(r["ulysses"] == r["ring"] == "1" and r["memory"] == "off" for r in rows)


def test_rows_match_the_memory_model(config_path, capsys):
    assert main([*BASE, "--model", str(config_path), "--top", "1"]) == 0
    (row,) = _table(capsys.readouterr().out)
    setting = _setting(row)
    from transformers import LlamaConfig

    est = estimate_memory(ModelDims.from_config(LlamaConfig(**CONFIG)), setting, world=16, tokens=65536)
    assert row["peak GiB"] == f"{est.peak / 2**30:.1f}"
    assert int(row["dp"]) * setting.sp == 16


def test_show_infeasible_marks_them_after_the_feasible(config_path, capsys):
    assert main([*BASE, "--model", str(config_path), "--top", "3", "--show-infeasible"]) == 0
    rows = _table(capsys.readouterr().out)
    fits = [r["fits"] for r in rows]
    assert fits[:3] == ["yes"] * 3
    assert len(fits) > 3 and all(f.startswith("no: ") for f in fits[3:])
    assert any("GPU" in f for f in fits[3:])


def test_too_small_gpu_memory_says_so(config_path, capsys):
    rc = main(["plan", "--model", str(config_path), "--gpus", "2", "--gpu-memory", "100MiB", "--host-memory",
               "64GiB", "--seq-len", "65536", "--microbatches", "4"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "no setting fits" in err and "GPU memory binds" in err and "--gpu-memory 0.1 GiB" in err
    assert "held unsharded" in err and "--sync-each-microbatch" in err  # the held gradients of 4 micro-batches named
    assert "fewer micro-batches per step (now 4" in err


def test_model_directory_and_missing_model(config_path, capsys, tmp_path):
    assert main([*BASE, "--model", str(config_path.parent), "--top", "1"]) == 0
    capsys.readouterr()
    assert main([*BASE, "--model", str(tmp_path / "nope" / "config.json")]) == 2
    assert "neither a config.json" in capsys.readouterr().err


def test_parse_size():
    assert parse_size("80GiB") == 80 * 2**30
    assert parse_size("512 GB") == 512e9
    assert parse_size("25GB/s") == 25e9
    for bad in ("eighty", "80XB", "0GiB"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def test_plot_writes_a_png(config_path, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [100, 5000, 300, 20000, 70000, 800] * 50))
    png = tmp_path / "load.png"
    assert main([*BASE, "--model", str(config_path), "--top", "1", "--plot", str(png),
                 "--lengths-file", str(lengths)]) == 0
    out = capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"lengths from {lengths}" in out and "synchronised step / ideal" in out


def test_suggestion_is_the_top_row_and_fits_where_the_memory_model_says(config_path, capsys):
    """`suggest()` and the CLI give the same answer (mesh + memory preset); its estimated peak
    fits the GPU, and with the GPU just below that peak the plan no longer suggests it."""
    from transformers import LlamaConfig

    from hf_longctx.capacity.search import Cluster, preset_setting, suggest

    assert main([*BASE, "--model", str(config_path), "--top", "1"]) == 0
    out = capsys.readouterr().out
    (row,) = _table(out)
    config = LlamaConfig(**CONFIG)
    cluster = Cluster(gpus=16, gpu_memory=3 * 2**30, host_memory=64 * 2**30)
    best = suggest(config, cluster, 65536)
    assert best.code() in out
    kw = best.init_kwargs
    assert (str(kw["ulysses_degree"]), str(kw["ring_degree"]), str(kw["fpdt_chunks"]), best.memory) == (
        row["ulysses"], row["ring"], row["fpdt"], row["memory"])
    setting = preset_setting(kw["ulysses_degree"], kw["ring_degree"], kw["fpdt_chunks"], best.memory,
                             ModelDims.from_config(config))
    assert setting == replace(best.candidate.setting, param_offload=False)
    peak = estimate_memory(ModelDims.from_config(config), setting, world=16, tokens=65536).peak
    assert peak <= 0.9 * cluster.gpu_memory
    tighter = Cluster(gpus=16, gpu_memory=peak / 0.9 * 0.999, host_memory=64 * 2**30)
    try:
        other = suggest(config, tighter, 65536)
    except ValueError as e:
        assert "no setting fits" in str(e)
    else:
        assert other.candidate.memory.peak < peak and other.candidate.setting != setting


def test_presets_in_the_plan_are_the_patch_presets():
    from hf_longctx.config import preset_knobs
    from hf_longctx.capacity.search import preset_setting

    for u in (1, 4):
        off, balanced, top = (preset_setting(2, 1, u, m) for m in ("off", "balanced", "max"))
        assert (off.mlp_chunks, off.loss_chunks, off.checkpoint, off.kv_offload) == (1, 1, False, False)
        assert (balanced.mlp_chunks, balanced.loss_chunks, balanced.checkpoint) == (2 * u, 0, False)
        assert (top.mlp_chunks, top.checkpoint, top.kv_offload) == (2 * u, True, u > 1)
        assert top.kv_offload == preset_knobs("max", u).get("kv_offload")


def test_plot_flex_shows_layouts_and_per_rank_load(config_path, tmp_path, capsys):
    """`--plot --flex`: the step is planned with flexible groups; the output names every
    slot's layout (each tiling the 16 ranks) and the per-rank busy max/mean, and compares
    with the suggestion's fixed degree on the same step."""
    pytest.importorskip("matplotlib")
    import re

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [100, 5000, 300, 20000, 70000, 800] * 50))
    png = tmp_path / "flex.png"
    assert main([*BASE, "--model", str(config_path), "--top", "1", "--plot", str(png), "--flex",
                 "--lengths-file", str(lengths)]) == 0
    out = capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    slots = re.search(r"slot layouts ((?:\[[\d+]+\] ?)+);", out).group(1).split()
    assert slots and all(sum(int(x) for x in slot.strip("[]").split("+")) == 16 for slot in slots), slots
    assert re.search(r"per-rank busy max/mean = \d+\.\d+", out) and "modelled speed-up of flexible groups" in out


def test_gradient_sync_memory(config_path, capsys):
    """By default (the trainer's: reduce-scatter in the step's last backward) every row holds
    the fp32 unsharded gradients, 4 B/param, in its grads; `--sync-each-microbatch` holds them
    sharded, 4 B/param / 16 GPUs (the row equals the model with grad_sync="microbatch");
    `--unequal-calls` with it is refused."""
    from transformers import LlamaConfig

    assert main([*BASE, "--model", str(config_path), "--top", "1", "--microbatches", "4"]) == 0
    (held,) = _table(capsys.readouterr().out)
    assert main([*BASE, "--model", str(config_path), "--top", "1", "--sync-each-microbatch", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    (synced,) = _table(out)
    assert "--sync-each-microbatch" in out
    dims = ModelDims.from_config(LlamaConfig(**CONFIG))
    setting = _setting(synced)
    est = estimate_memory(dims, setting, world=16, tokens=65536, grad_sync="microbatch", microbatches=4)
    assert est.held == 4 * dims.params / 16 and synced["peak GiB"] == f"{est.peak / 2**30:.1f}"
    assert float(held["grads"]) - float(synced["grads"]) == pytest.approx(4 * dims.params * 15 / 16 / 2**30, abs=0.11)
    assert main([*BASE, "--model", str(config_path), "--unequal-calls", "--sync-each-microbatch"]) == 2
    with pytest.raises(ValueError, match="grad_sync must be 'step'"):
        estimate_memory(dims, setting, world=16, tokens=65536, unsharded_step=True, grad_sync="microbatch")


def test_unequal_calls_memory_and_plot(config_path, tmp_path, capsys):
    """`--unequal-calls`: every row's peak is the memory model's with the whole model
    gathered for the step (params grow by at least dt·P − the two gathered units; the fp32
    unsharded gradients are held as in the default), and `--flex --plot` plans the step
    with unequal counts: slots need not tile the ranks, the output gives the per-rank
    micro-batch range."""
    pytest.importorskip("matplotlib")
    import re

    from transformers import LlamaConfig

    assert main([*BASE, "--model", str(config_path), "--top", "1", "--microbatches", "4"]) == 0
    (plain,) = _table(capsys.readouterr().out)
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [100, 5000, 300, 20000, 70000, 800] * 50))
    png = tmp_path / "unequal.png"
    assert main([*BASE, "--model", str(config_path), "--top", "1", "--microbatches", "4", "--unequal-calls", "--plot", str(png), "--flex",
                 "--lengths-file", str(lengths)]) == 0
    out = capsys.readouterr().out
    (row,) = _table(out)
    setting = _setting(row)
    dims = ModelDims.from_config(LlamaConfig(**CONFIG))
    est = estimate_memory(dims, setting, world=16, tokens=65536, unsharded_step=True, microbatches=4)
    base = estimate_memory(dims, setting, world=16, tokens=65536, microbatches=4)
    assert row["peak GiB"] == f"{est.peak / 2**30:.1f}" and est.held == 4 * dims.params
    assert est.params - base.params >= 2 * dims.params - 2 * (2 * dims.layer_params + dims.vocab * dims.hidden)
    assert float(row["params"]) > float(plain["params"]) and row["grads"] == plain["grads"]  # held fp32 grads in both
    assert "--unequal-calls: every rank holds the whole model" in out
    assert "unequal micro-batch counts" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lo, hi = map(int, re.search(r"micro-batches per rank (\d+)-(\d+)", out).groups())
    assert 1 <= lo <= hi
