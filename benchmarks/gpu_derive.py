"""The achieved fractions of capacity/gpus.py, derived again from the committed H200 profiles.

Where it sits: `benchmarks/gpu_model.py --derive`; tests/unit/test_gpu_derive.py holds
`capacity/gpus.py` to what it derives. A constant is a profile's kernel time set against the
work the inventory of the PROFILED code counts for the same kernels (the profiles ran the code
at 42880f9, whose op inventory is 766ac1f's: `_model_at.model_at`), never against today's:
GEMM from the 8B profile's GEMM class; flash-attn forward / backward per call from each
profile's kernels; elementwise HBM from the fp32 gradient-sum adds; PCIe from the host copies.
The profiles' configurations (`PROFILED`) are in-sample rows of the backtest. The profile of
the code as it is (2765bd3) checks two classes out of the derivation's sample. `derive()`
returns every figure with the rule that turns it into the constant; `mismatches()` lists where
a constant of `capacity/gpus.py` is not what the rule gives.
"""

from __future__ import annotations

from benchmarks._model_at import model_at
from benchmarks.gpu_results import read
from hf_longctx.capacity.gpus import GPUS

# The steps whose kernel profiles gave the constants: (card, shape, layers, preset, tokens, code).
PROFILED = (("h200", "8b", 2, "max", 32768, "42880f9"), ("h200", "1b", 16, "max", 32768, "42880f9"))
CHECKED = ("h200", "8b", 2, "max", 32768, "2765bd3")  # a profile of the code as it is, not used for a constant
HEAD_DIM = {"8b": 128, "1b": 64}
HEADS = 32
NOT_REPRODUCED = {
    "launch_s": "the 1B profile's neg kernel takes 4.25 us a call (committed), but which tensors its 3,136 calls "
                "negate (the bytes to subtract) is the run's note, not committed data",
    "collective_s": "assumed: no multi-GPU run has been profiled",
    "nccl": "nccl-tests' published all-to-all figures, not a measurement here",
}


def _ops(rows: list) -> list[list[dict]]:
    """Per profiled row, every op of its step by the inventory of its code (one child per
    commit), `count` spanning the layers."""
    out: dict = {}
    for commit in {r.inventory for r in rows}:
        mine = [r for r in rows if r.inventory == commit]
        got = model_at(commit, [dict(card=r.card, shape=r.shape, layers=r.layers, preset=r.preset, tokens=r.tokens)
                                for r in mine], want="ops")
        for r, g in zip(mine, got):
            if "error" in g:
                raise RuntimeError(f"the inventory at {commit} cannot list {r.config}: {g['error']}")
            out[id(r)] = g["step"] + [dict(o, count=o["count"] * r.layers) for o in g["layer"]]
    return [out[id(r)] for r in rows]


def _kernel(profile: dict, part: str) -> tuple[float, int]:
    """(seconds, calls) of the top kernels whose name holds `part`."""
    hits = [(s, c) for name, s, c in profile["top"] if part in name]
    return sum(s for s, _ in hits), sum(c for _, c in hits)


def _profile(results, card, shape, layers, preset, tokens, code) -> tuple:
    """(the profile, its row) of that configuration run by that code."""
    return next((p, row) for row, p in results.profiles
                if row.config == (card, shape, layers, preset, tokens) and row.code == code)


def derive(results=None) -> dict:
    """{constant: {"per profile": {shape: value}, "rule": how the constant follows}} and the
    checks of the code as it is (see the module docstring)."""
    results = read() if results is None else results
    peak = GPUS["h200"].bf16_flops
    out = {"gemm": {}, "attention": {}, "hbm": {}, "pcie_h2d": {}, "pcie_d2h": {}}
    found = [_profile(results, *p) for p in PROFILED]
    for (prof, row), ops in zip(found, _ops([row for _, row in found])):
        shape, tokens = row.shape, row.tokens
        gemm = sum(o["flops"] * o["count"] for o in ops if o["kind"] == "gemm")
        out["gemm"][shape] = gemm / prof["classes"]["gemm"][0] / peak
        pair_flops = tokens * (tokens + 1) / 2 * HEADS * HEAD_DIM[shape]  # causal pairs x H x D
        (fs, fc), (bs, bc) = _kernel(prof, "flash_fwd"), _kernel(prof, "flash_bwd")
        out["attention"][HEAD_DIM[shape]] = (4 * pair_flops / (fs / fc) / peak, 10 * pair_flops / (bs / bc) / peak)
        adds = [o for o in ops if o["what"] == "add_" and o["bytes"] >= 10 * {"8b": 4096, "1b": 2048}[shape]]
        add_s, add_n = _kernel(prof, "CUDAFunctor_add<float>")
        out["hbm"][shape] = (sum(o["bytes"] * o["count"] for o in adds) / add_s / GPUS["h200"].hbm_bw,
                             sum(o["count"] for o in adds), add_n)
        for kind, name, key in (("h2d", "Memcpy HtoD", "pcie_h2d"), ("d2h", "Memcpy DtoH", "pcie_d2h")):
            moved = sum(o["bytes"] * o["count"] for o in ops if o["kind"] == kind and o["stream"] == "side")
            out[key][shape] = moved / _kernel(prof, name)[0]
    out["checks"] = _checks(results)
    return out


def _checks(results) -> dict:
    """The code as it is (its own profile, its own inventory): the elementwise and copy classes'
    achieved HBM fraction with the launches taken off, and the GEMM class as the model times it."""
    prof, row = _profile(results, *CHECKED)
    (ops,), g = _ops([row]), GPUS["h200"]
    ew = [o for o in ops if o["kind"] == "elementwise"]
    t = prof["classes"]["elementwise/reduction"][0] + prof["classes"]["copy"][0]
    n = sum(o["count"] for o in ew)
    hbm = sum(o["bytes"] * o["count"] for o in ew) / ((t - n * g.launch_s) * g.hbm_bw)
    gemm = sum(o["count"] * (max(o["flops"] / (g.gemm * g.bf16_flops), o["bytes"] / (g.hbm * g.hbm_bw)) + g.launch_s)
               for o in ops if o["kind"] == "gemm")
    return {"hbm": hbm, "gemm model s": gemm, "gemm profile s": prof["classes"]["gemm"][0]}


def mismatches(d: dict, g=None) -> list[str]:
    """Where `g` (capacity/gpus.py's H200 entry by default) is not what the rules give (empty:
    it reproduces them)."""
    g, bad = GPUS["h200"] if g is None else g, []
    if round(d["gemm"]["8b"], 2) != g.gemm:
        bad.append(f"gemm {g.gemm} != the 8B profile's {d['gemm']['8b']:.3f} to 2 decimals")
    for dim, fwd, bwd in g.attention:
        got = d["attention"].get(dim)
        if got is None or (round(got[0], 3), round(got[1], 3)) != (fwd, bwd):
            bad.append(f"attention at head dim {dim}: {(fwd, bwd)} != {got}")
    hbm = sorted(v[0] for v in d["hbm"].values())
    lo, hi = hbm[0], hbm[-1]
    if not lo <= g.hbm <= hi:
        bad.append(f"hbm {g.hbm} outside the profiles' {lo:.3f}..{hi:.3f}")
    for key in ("pcie_h2d", "pcie_d2h"):
        if {round(v / 1e9) for v in d[key].values()} != {round(getattr(g, key) / 1e9)}:
            bad.append(f"{key} {getattr(g, key) / 1e9:g} GB/s != the profiles' {sorted(d[key].values())}")
    return bad


def print_derivation(d: dict | None = None) -> dict:
    """Print `derive()` (or `d`, one already computed); return it."""
    d = derive() if d is None else d
    print("\nAchieved fractions of capacity/gpus.py from the H200 profiles of the code at 42880f9 (kernel time) and "
          "that code's inventory (766ac1f: the work of the same kernels)")
    print(f"- gemm: {d['gemm']['8b']:.3f} (8B profile) -> {GPUS['h200'].gemm} (the 8B figure to 2 decimals; "
          f"the 1B profile gives {d['gemm']['1b']:.3f}, not used)")
    for dim, (fwd, bwd) in sorted(d["attention"].items()):
        print(f"- attention, head dim {dim}: forward {fwd:.3f}, backward {bwd:.3f} of peak (per call)")
    print("- hbm: " + "; ".join(f"{k}: {v[0]:.3f} ({v[1]:.0f} fp32 gradient-sum adds in the inventory, {v[2]} in "
                                "the profile)" for k, v in d["hbm"].items()) + f" -> {GPUS['h200'].hbm} (between them)")
    for key in ("pcie_h2d", "pcie_d2h"):
        print(f"- {key}: " + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in d[key].items()) +
              f" -> {getattr(GPUS['h200'], key) / 1e9:g} GB/s")
    for name, why in NOT_REPRODUCED.items():
        print(f"- {name}: not reproduced from committed data: {why}")
    c = d["checks"]
    print(f"- the code as it is (2765bd3, its own profile and inventory; not used for a constant): elementwise + copy "
          f"classes {c['hbm']:.3f} of HBM with the launches taken off (the constant: {GPUS['h200'].hbm}); GEMM class "
          f"{c['gemm model s']:.3f} s modelled vs {c['gemm profile s']:.3f} s profiled")
    bad = mismatches(d)
    print("- capacity/gpus.py " + ("reproduces every rule above" if not bad else "DIFFERS: " + "; ".join(bad)))
    return d
