"""The step-time model against every GPU run held, each row against the code it measured.

Where it sits: `benchmarks/gpu_model.py --backtest`. It reads every result file
(`gpu_results.read`: the naming rule, each run's card, date and code commit) and prints, per
measured configuration: the model of the code that run measured (that commit's op inventory,
`_model_at.model_at`, with the working tree's constants and roofline) and its error, the
model of the code as it is (`gpu_predictions.predict_rows`), the measured MFU by the three
counts of `capacity/mfu.py`, and whether the row is in-sample (its configuration is a step
whose kernel profile gave a constant, `gpu_derive.PROFILED`) or out-of-sample; then every
prediction committed before its run with its error; then what could not be read, and why.
"""

from __future__ import annotations

from benchmarks._model_at import ModelUnavailable, model_at
from benchmarks.gpu_derive import PROFILED
from benchmarks.gpu_predictions import predict_rows
from benchmarks.gpu_results import best_runs, read

IN_SAMPLE = {p[:5] for p in PROFILED}


def _spec(r) -> dict:
    return dict(card=r.card, shape=r.shape, layers=r.layers, preset=r.preset, tokens=r.tokens)


def models_of_measured(rows: list) -> tuple[list, dict]:
    """(per row the model of the code it measured, or {"error": why}; {commit: why} for the
    commits whose model could not be evaluated here)."""
    out, failed = {}, {}
    for commit in sorted({r.inventory for r in rows}):
        mine = [r for r in rows if r.inventory == commit]
        try:
            got = model_at(commit, [_spec(r) for r in mine])
        except ModelUnavailable as e:
            failed[commit] = str(e)
            got = [{"error": str(e)}] * len(mine)
        out.update({id(r): g for r, g in zip(mine, got)})
    return [out[id(r)] for r in rows], failed


def _mfus(r) -> dict:
    from benchmarks.gpu_throughput import config
    from hf_longctx.capacity.gpus import GPUS
    from hf_longctx.capacity.mfu import by_convention
    from hf_longctx.data.model_dims import ModelDims

    f = by_convention(ModelDims.from_config(config(r.shape, r.layers)), r.tokens,
                      checkpointed=r.preset.split("+")[0] in ("high", "max"))
    return {k: v / (r.seconds * GPUS[r.card].bf16_flops) for k, v in f.items()}


def backtest(results=None) -> dict:
    """{"rows": one dict per measured configuration and code, "predictions": one per predicted
    row with the measurement that answers it, "unread": [(source, why)], "failed": {commit:
    why}} (see the module docstring)."""
    results = read() if results is None else results
    runs = sorted(best_runs(results.measured), key=lambda r: (r.card, r.date, r.code, r.shape, r.tokens, r.preset))
    then, failed = models_of_measured(runs)
    rows = []
    for r, m in zip(runs, then):
        (now,) = predict_rows([_spec(r)], r.card)
        rows.append(dict(run=r, then=m, now=now, mfu=_mfus(r), sample="in" if r.config in IN_SAMPLE else "out",
                         error=(m["seconds"] / r.seconds - 1) if "seconds" in m else None))
    predictions = []
    for p in results.predicted:
        hits = [r for r in runs if r.predictions == p.source and r.config == p.config]
        for r in hits or [None]:
            predictions.append(dict(prediction=p, run=r, error=(p.seconds / r.seconds - 1) if r else None))
    return {"rows": rows, "predictions": predictions, "unread": results.unread, "failed": failed}


def print_backtest(b: dict | None = None) -> dict:
    """Print `backtest()` (or `b`, one already computed) as tables; return it."""
    from hf_longctx.capacity.mfu import MEGATRON_DEEPSPEED, STRICT, TORCHTITAN

    b = backtest() if b is None else b
    print("Backtest: one GPU, one document, forward + backward (no optimizer step). 'model of that code': the op "
          "inventory of the commit the run measured (or of the commit named as modelling it), timed with the constants "
          "and roofline of the working tree; 'model of the code as it is': today's inventory. Sample 'in': the run's "
          "configuration is a step whose kernel profile gave a constant (capacity/gpus.py).")
    print("| card | date | code measured (inventory) | widths | layers | memory | tokens | sample | measured s | "
          "model of that code s | error (model / measured - 1) | model of the code as it is s | measured MFU strict / torchtitan / "
          "Megatron-DS | attention s | GEMM s | HBM s | launch s | binds |")
    print("|" + "---|" * 18)
    for x in b["rows"]:
        r, m, now, f = x["run"], x["then"], x["now"], x["mfu"]
        code = r.code if r.inventory == r.code else f"{r.code} ({r.inventory})"
        model = (f"{m['seconds']:.3f} | {100 * x['error']:+.1f} %" if x["error"] is not None
                 else f"n/a: {m['error'][:60]} | ")
        terms = m if "seconds" in m else {"attention": now["attention_s"], "gemm": now["gemm_s"], "hbm": now["hbm_s"],
                                          "launches": now["launches_s"], "binds": now["binds"]}
        print(f"| {r.card.upper()} | {r.date} | {code} | {r.shape.upper()} | {r.layers} | {r.preset} | {r.tokens:,} | "
              f"{x['sample']} | {r.seconds:.3f} | {model} | {now['predicted_s']:.3f} | {100 * f[STRICT]:.1f} / "
              f"{100 * f[TORCHTITAN]:.1f} / {100 * f[MEGATRON_DEEPSPEED]:.1f} % | {terms['attention']:.3f} | "
              f"{terms['gemm']:.3f} | {terms['hbm']:.3f} | {terms['launches']:.3f} | {terms['binds']} |")
    for sample, name in (("in", "in-sample"), ("out", "out-of-sample")):
        errs = [x["error"] for x in b["rows"] if x["sample"] == sample and x["error"] is not None]
        if errs:
            print(f"{name} rows: model of that code / measured {1 + min(errs):.2f}..{1 + max(errs):.2f} "
                  f"({len(errs)} rows)")
    print("(The rows at 32K of either width run the profiled flash-attn kernels, same length and head dim: their "
          "attention time is in-sample whatever the memory preset.)")
    print("\nPredictions committed before their runs (out-of-sample by construction):")
    print("| predictions file | predicted by | card | widths | layers | memory | tokens | predicted s | measured s | "
          "run (code, file) | error |")
    print("|" + "---|" * 11)
    for x in b["predictions"]:
        p, r = x["prediction"], x["run"]
        got = f"{r.seconds:.3f} | {r.code}, {r.source} | {100 * x['error']:+.1f} %" if r else "not run yet | | "
        print(f"| {p.source} | {p.code} | {p.card.upper()} | {p.shape.upper()} | {p.layers} | {p.preset} | "
              f"{p.tokens:,} | {p.seconds:.3f} | {got} |")
    for commit, why in b["failed"].items():
        print(f"model of the code at {commit}: not evaluated here ({why})")
    for source, why in b["unread"]:
        print(f"unread: {source}: {why}")
    return b
