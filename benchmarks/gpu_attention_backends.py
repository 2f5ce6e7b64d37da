"""Every attention backend on one GPU, side by side: exactness, kernel TFLOP/s, patched steps.

Where it sits: the device check of `ops/backends/` and of the measured fractions in
`capacity/gpus.py` (docs/guides/gpu-check.md "Attention backends"). One command, bounded (about
5 minutes on one H100, `--budget` 470 s, every subprocess under a timeout: a hang is a "TIMED OUT
after N s" row). Before any GPU work it requires -- or writes -- the predictions of this code
(`gpu_predictions.write_predictions`: `results/predictions_<date>_<card>.json`, the predicting
commit, the step rows, the step-time model's seconds; this script's own carry the digest of
the sources, so a copy of the tree without git is told apart). Then, per backend
here (torch's flash ops = FA2, FA3 through torch where `flash_attn_interface` imports,
flash-attn 2.x, cuDNN through torch's ops, cuDNN through cudnn-frontend), one worker subprocess:
(a) exactness against the math kernel in fp32 on the shapes the code runs
(`_attention_cases.py`), (b) forward / backward TFLOP/s at 32K and 128K (32 / 8 heads of 128)
and 1M (4 / 1 heads: a rank of Ulysses 8). Then (c) 8B-width, 2-layer patched steps `max`,
`max+keep_attention`, `balanced` at 32K and `max+keep_attention` at 128K with the fastest exact
backend and with FA2 (`gpu_throughput.run_row`), and (d) the loss in chunks of 256 vs 2048 rows.
Results: `results/gpu_attention_backends_<card>.json`, markdown tables, and the
`measured_attention` rows to add to `capacity/gpus.py`.

`--dry-run` (CPU): every path it can with emulated kernels and tiny shapes, a tiny CPU patched
step per step row, the predictions, and the plan of the GPU run. `--predict` writes the
predictions only (CPU; commit them before the GPU run).

Run: python benchmarks/gpu_attention_backends.py [--dry-run | --predict] [--card h100] [--out DIR] [--budget 470]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import _attention_cases as cases_mod  # noqa: E402

_ROW = "ATTENTION_BACKEND_ROW "
SPEED = [(1 << 15, (32, 8)), (1 << 17, (32, 8)), (1 << 20, (4, 1))]  # (tokens, (H, H_kv)), head dim 128
STEPS = [("max", 1 << 15), ("max+keep", 1 << 15), ("balanced", 1 << 15), ("max+keep", 1 << 17)]
LOSS_ROWS = [(1 << 15, 256), (1 << 15, 2048)]  # (tokens, rows per loss chunk), balanced's MLP chunks
TIMEOUT = {"backend": 180, "step": 150}
EXACT_TOKENS, HEAD_DIM = 3072, 128


def code_digest() -> str:
    """A digest of the package and benchmark sources: tells code apart where git is absent (a
    device machine holding a copy of the tree)."""
    digest = hashlib.sha256()
    for path in sorted([*ROOT.glob("hf_longctx/**/*.py"), *HERE.glob("*.py")]):
        digest.update(path.relative_to(ROOT).as_posix().encode() + path.read_bytes())
    return digest.hexdigest()[:16]


PREDICTED = [dict(shape="8b", layers=2, preset=p, tokens=t) for p, t in STEPS]  # (d)'s rows predict as balanced


def prediction_file(out: Path, card: str) -> tuple[Path | None, dict]:
    """The predictions of this code on `card` by the project's prediction API
    (`gpu_predictions.write_predictions`: the step-time model of the code as it is, the
    predicting commit, never overwritten): the one this script wrote for these sources (by
    digest) when there is one -- written here and committed before the run, or carried to the
    device with the tree -- else a new one, written now, before any GPU work. Predictions of
    other sources stop the run (exit 2). A card without measured fractions (A100) has none."""
    from benchmarks.gpu_predictions import write_predictions
    from hf_longctx.capacity.step_time import UntimedGPU

    tag = f"benchmarks/gpu_attention_backends.py, sources {code_digest()}"
    held = sorted(out.glob(f"predictions_*_{card}.json"))
    for path in reversed(held):
        data = json.loads(path.read_text())
        if "gpu_attention_backends.py" in data.get("written", ""):
            if tag not in data["written"]:
                raise SystemExit(f"{path} predicts other sources ({data['written']}; these: {code_digest()}): move it "
                                 "away and rerun to predict this code first")
            return path, data
    try:
        path = write_predictions(out, PREDICTED, card, note=tag)
    except UntimedGPU as exc:
        return None, {"code": "-", "rows": [], "untimed": str(exc)}
    except FileExistsError as exc:
        raise SystemExit(f"{exc}: today's predictions for {card} are another run's; move them away first") from exc
    return path, json.loads(path.read_text())


def backends(dry: bool) -> dict:
    """label -> PackedBackend of every packed kernel here (emulated on CPU for the dry run), and
    label -> why absent."""
    from hf_longctx.ops.backends import select
    from hf_longctx.ops.backends.packed import PackedBackend

    if dry:
        from tests.helpers.emulated_backends import cuda_env

        env, _ = cuda_env(flash="2.8.3", cudnn="H,T", frontend=True)
    else:
        env = select.probe_env(torch.device("cuda"))
    found, absent = {}, {}
    for label, _, kernel, why in env.kernels():
        if kernel is None:
            absent[label] = why
        else:
            found[label] = PackedBackend(label, kernel)
    fa3 = "torch_flash[FA3]"
    if not dry and env.torch_flash is not None and env.torch_impl is None:
        import importlib.util

        if importlib.util.find_spec("flash_attn_interface") is not None and env.capability == (9, 0):
            found[fa3] = PackedBackend(fa3, env.torch_flash)  # activated inside its own worker
        else:
            absent[fa3] = "flash_attn_interface (FA3) is not installed, or this GPU is not sm90"
    return found, absent


def worker(label: str, dry: bool) -> list[dict]:
    """(a) and (b) for one backend, in this process: exactness rows, then speed rows."""
    if label.startswith("torch_flash[") and not dry:
        torch.nn.attention.activate_flash_attention_impl(label[len("torch_flash["):-1])
    backend = backends(dry)[0][label]
    device = torch.device("cpu" if dry else "cuda")
    tokens, heads, dim = (48, (4, 1), 8) if dry else (EXACT_TOKENS, (32, 8), HEAD_DIM)
    rows = [{"backend": label, "kind": "exact", **cases_mod.exact(backend, c, dim, device)} for c in cases_mod.cases(tokens, heads)]
    shapes = [(64, (4, 1), 8), (32, (4, 1), 8)] if dry else [(t, h, HEAD_DIM) for t, h in SPEED]
    for n, (t, h, d) in enumerate(shapes):  # the last length once: its warm-up is its measurement
        rows.append({"backend": label, "kind": "speed", **cases_mod.speed(backend, t, h, d, device,
                                                                          repeat=0 if n == len(shapes) - 1 else 1)})
    return rows


def bounded(cmd: list[str], timeout: float, label: str) -> list[dict]:
    """The rows `cmd` prints, or one error row: a command past `timeout` is killed ("TIMED OUT")."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired:
        return [{"backend": label, "kind": "error", "error": f"TIMED OUT after {timeout:g} s: {label} worker (killed)"}]
    rows = [json.loads(line[len(_ROW):]) for line in proc.stdout.splitlines() if line.startswith(_ROW)]
    if proc.returncode != 0:
        rows.append({"backend": label, "kind": "error", "error": f"exit {proc.returncode}: {proc.stdout[-1500:]}"})
    return rows


def run_worker(label: str, timeout: float) -> list[dict]:
    return bounded([sys.executable, str(Path(__file__).resolve()), "--worker", label], timeout, label)


def seconds_per_pair(rows: list[dict], label: str) -> float | None:
    """4 / fwd + 10 / bwd TFLOP/s of `label` at 128K (what `GPU.attention_ranking` orders by)."""
    speed = [r for r in rows if r["backend"] == label and r["kind"] == "speed" and r["tokens"] == SPEED[1][0]]
    return 4 / speed[0]["forward_tflops"] + 10 / speed[0]["backward_tflops"] if speed else None


def fastest_exact(rows: list[dict], labels) -> str:
    exact = [b for b in labels
             if all(r.get("exact", True) for r in rows if r["backend"] == b and r["kind"] == "exact")
             and not any(r["backend"] == b and r["kind"] == "error" for r in rows) and seconds_per_pair(rows, b)]
    return min(exact, key=lambda b: seconds_per_pair(rows, b)) if exact else "torch_flash"


def step_rows(best: str, left, dry: bool) -> list[dict]:
    """(c) and (d): patched steps through `gpu_throughput.run_row` (one bounded subprocess each); in
    the dry run the same patch() keywords on a tiny CPU model in this process."""
    from benchmarks import gpu_throughput

    plan = [(p, t, None, b) for p, t in STEPS for b in dict.fromkeys((best, "torch_flash"))]
    plan += [("chunked", t, r, best) for t, r in LOSS_ROWS]
    rows = []
    for preset, tokens, loss_rows, backend in plan:
        knobs = {"attention_backend": "aten_cpu" if dry else backend}
        if loss_rows:
            knobs["loss_chunks"] = max(1, (64 if dry else tokens) // (loss_rows // 32 if dry else loss_rows))
        head = {"preset": preset, "tokens": tokens, "loss_rows": loss_rows, "backend": backend}
        if dry:
            rows.append({**head, **_tiny_step(preset, knobs)})
            continue
        timeout = min(TIMEOUT["step"], left() - 5)
        if timeout < 30:
            rows.append({**head, "fits": None, "error": "SKIPPED: the --budget is spent"})
            continue
        row = gpu_throughput.run_row("8b", 2, preset, tokens, 1, False, timeout, json.dumps(knobs))
        rows.append({**head, **{k: v for k, v in row.items() if k in ("fits", "seconds", "peak_gib", "error")}})
    return rows


def _tiny_step(preset: str, knobs: dict) -> dict:
    """One forward + backward of a 2-layer Llama of 64 tokens on CPU with `preset` and `knobs`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.gpu_throughput import PRESET_KWARGS
    from hf_longctx import init_sequence_parallel, patch, shard_batch

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=16, vocab_size=128)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    mesh = init_sequence_parallel()
    memory, extra = PRESET_KWARGS.get(preset, (preset, {}))
    model = patch(LlamaForCausalLM(cfg), mesh, memory=memory, **extra, **knobs)
    ids = torch.randint(0, 128, (1, 64))
    t0 = time.perf_counter()
    model(**shard_batch({"input_ids": ids, "labels": ids}, mesh)).loss.backward()
    return {"fits": True, "seconds": round(time.perf_counter() - t0, 4), "cpu_dry_run": True}


def report(rows: list[dict], steps: list[dict], prediction: dict, peak: float) -> dict:
    """Print the tables; return the `measured_attention` rows to add to capacity/gpus.py."""
    print("\n(a) exactness against the math kernel in fp32 (bf16 inputs; out < 2e-2, grads < 4e-2)")
    print("| backend | case | exact | out | lse | dq | dk | dv |\n|---|---|---|---|---|---|---|---|")
    for r in (r for r in rows if r["kind"] in ("exact", "error")):
        if r["kind"] == "error" or "skipped" in r:
            print(f"| {r['backend']} | {r.get('case', '-')} | {r.get('error') or 'refused: ' + r['skipped']} ||||||")
        else:
            print(f"| {r['backend']} | {r['case']} | {'yes' if r['exact'] else 'NO'} | " + " | ".join(
                f"{r[k]:.2e}" for k in ("out", "lse", "dq", "dk", "dv")) + " |")
    print("\n(b) causal, one document, head dim 128: TFLOP/s (fraction of peak)")
    print("| backend | tokens | H / H_kv | forward | backward |\n|---|---|---|---|---|")
    suggested = {}
    for r in (r for r in rows if r["kind"] == "speed"):
        fwd, bwd = r["forward_tflops"] * 1e12 / peak, r["backward_tflops"] * 1e12 / peak
        print(f"| {r['backend']} | {r['tokens']:,} | {r['heads']} / {r['kv_heads']} | {r['forward_tflops']:.1f} ({fwd:.3f}) | "
              f"{r['backward_tflops']:.1f} ({bwd:.3f}) |")
        if r["tokens"] == SPEED[0][0]:  # the length the torch_flash fractions were derived at
            suggested[r["backend"]] = f'("{r["backend"]}", (({r["head_dim"]}, {fwd:.3f}, {bwd:.3f}),)),'
    predicted = {(p["preset"], p["tokens"]): p["predicted_s"] for p in prediction["rows"]}  # the modelled kernel's
    dry = any(s.get("cpu_dry_run") for s in steps)
    print("\n(c, d) 8B widths, 2 layers, one document: step seconds, measured against the step-time model's prediction "
          "(the kernel it models; the loss rows predict as balanced: no term of the model depends on a loss chunk's "
          "rows)" + (" (dry run: a tiny model on the CPU, not comparable)" if dry else ""))
    print("| backend | memory | tokens | loss rows | measured s | predicted s | measured / predicted | peak GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for s in steps:
        pred = predicted.get((s["preset"].replace("chunked", "balanced"), s["tokens"]))
        pred = round(pred, 3) if pred else None
        got = f"{s['seconds']:.3f}" if s.get("fits") else s.get("error", "out of memory")
        ratio = f"{s['seconds'] / pred:.2f}" if s.get("fits") and pred and not s.get("cpu_dry_run") else "-"
        print(f"| {s['backend']} | {s['preset']} | {s['tokens']:,} | {s['loss_rows'] or '-'} | {got} | {pred or '-'} | "
              f"{ratio} | {s.get('peak_gib', 0):.1f} |")
    if suggested:
        print("\nmeasured_attention rows for capacity/gpus.py (exact backends only; fractions at 32K):")
        exact_ok = {b for b in suggested if all(r.get("exact", True) for r in rows if r["backend"] == b)}
        for b in sorted(exact_ok):
            print("    " + suggested[b])
    return suggested


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU: emulated kernels, tiny shapes, the plan")
    parser.add_argument("--out", type=Path, default=None,
                        help="where the JSON files go (default: benchmarks/results; a temporary folder on a dry run)")
    parser.add_argument("--budget", type=float, default=470.0, help="seconds for the whole run (rows past it: SKIPPED)")
    parser.add_argument("--card", default=None, help="capacity/gpus.py entry (default: the device's; h100 on a dry run)")
    parser.add_argument("--predict", action="store_true", help="CPU: write this code's predictions for --card, then stop")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        for row in worker(args.worker, dry=False):
            print(_ROW + json.dumps(row), flush=True)
        return 0
    from hf_longctx.capacity.gpus import GPUS, key_of_device

    if args.out is None:  # a dry run's predictions stay out of results/, which the backtest reads
        args.out = Path(tempfile.mkdtemp(prefix="gpu_attention_backends_")) if args.dry_run else HERE / "results"
    if args.predict:
        path, data = prediction_file(args.out, args.card or "h100")
        print(f"predictions: {path or data.get('untimed')}")
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run on CPU")
    name = "CPU dry run" if args.dry_run else torch.cuda.get_device_name()
    card = args.card or ("h100" if args.dry_run else key_of_device(name))
    if card not in GPUS:
        raise SystemExit(f"{name!r} is no entry of capacity/gpus.py ({sorted(GPUS)}): pass --card")
    path, prediction = prediction_file(args.out, card)
    start = time.monotonic()
    left = lambda: args.budget - (time.monotonic() - start)  # noqa: E731
    found, absent = backends(args.dry_run)
    print(f"{name}: card {card}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; predictions "
          f"{path or prediction.get('untimed')} (code {prediction['code']}, sources {code_digest()})")
    print(f"plan: backends {sorted(found)} (absent: {absent or 'none'}); (a) {len(cases_mod.cases(48, (4, 1)))} exactness "
          f"cases of {EXACT_TOKENS} tokens, GQA 32/8; (b) {[t for t, _ in SPEED]} tokens; (c) {STEPS} with the fastest "
          f"exact backend and torch_flash; (d) loss chunks of {[r for _, r in LOSS_ROWS]} rows; budget {args.budget:g} s, "
          f"{TIMEOUT['backend']} s per backend worker, {TIMEOUT['step']} s per step row")
    rows = []
    for label in sorted(found):
        if args.dry_run:
            rows += worker(label, dry=True)
        elif left() < 60:
            rows.append({"backend": label, "kind": "error", "error": "SKIPPED: the --budget is spent"})
        else:
            rows += run_worker(label, min(TIMEOUT["backend"], left() - 30))
    best = fastest_exact(rows, found)
    steps = step_rows(best, left, args.dry_run)
    suggested = report(rows, steps, prediction, GPUS[card].bf16_flops)
    result = {"device": name, "card": card, "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
              "predictions": path.name if path else None, "sources": code_digest(), "absent": absent,
              "fastest_exact": best, "kernels": rows, "steps": steps, "suggested_measured_attention": suggested,
              "dry_run": args.dry_run}
    out = args.out / f"gpu_attention_backends_{'dryrun' if args.dry_run else card}.json"
    out.write_text(json.dumps(result, indent=1))
    if path is not None and not args.dry_run:  # FA2's rows beside their predictions, as the backtest reads them
        from benchmarks.gpu_predictions import record_run

        fa2 = [dict(shape="8b", layers=2, **{k: r.get(k) for k in ("preset", "tokens", "fits", "seconds", "peak_gib")})
               for r in steps if r["backend"] == "torch_flash" and r["loss_rows"] is None]
        print(f"wrote {record_run(path, fa2, device=name)}")
    failed = [r for r in rows if r.get("exact") is False or r["kind"] == "error"] + [s for s in steps if s.get("error")]
    print(f"\nwrote {out}; {len(failed)} row(s) failed or timed out; {time.monotonic() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
