"""The measured support matrix: every causal LM of the installed transformers through patch().

Where it sits: outside the library; it drives the public path (`AutoModelForCausalLM`,
`patch`, `shard_batch`, `global_loss`, `sum_gradients`) on 2 gloo ranks (the persistent
pool of tests/helpers/pool.py) exactly as a new user would, for every model type registered for
`AutoModelForCausalLM`:

1. build it tiny from its own config class (hidden 32, 4 layers, 4 heads / 2 KV heads, 4
   experts, every dropout 0; sliding windows of WINDOW and attention chunks of CHUNK tokens,
   both shorter than the test documents; zoo_configs.py: `_KINDS`: hybrids and window families get every
   kind of layer their checkpoints have; `_CHECKPOINT_FIELDS`: fields released checkpoints
   carry that the default config lacks) with `AutoModelForCausalLM.from_config` (a composite
   config mapped to a text-only model is swapped for its text config there),
   `save_pretrained`, reload with `from_pretrained`;
2. reference: the unpatched model in fp32 on the packed batch of DOCS (as
   DataCollatorWithFlattening makes it); when the model's own torch path leaks across packed
   documents (its packed loss differs from the documents run one at a time: hybrids, masks
   that ignore position_ids) the reference is the documents one at a time. A model that is
   random in training mode beyond dropout (PhiMoE samples its experts: two runs differ) is
   compared in eval mode, reference and SP alike (flagged `train_mode_random`);
3. `patch()` on a Ulysses-2 mesh and on a ring-2 mesh, one forward/backward of
   `shard_batch(batch)`, losses and gradients summed over the 2 ranks.

Verdicts: EXACT (loss <= 1e-6 relative, every gradient within 1e-4 of the largest reference
gradient), REFUSED (patch raised; the first cause is printed -- also when the unpatched
model cannot run on plain input_ids), WRONG (it ran but differs), CRASH (anything else
raised, or a hang past the per-model timeout), SKIP (no tiny model could be built, or it
cannot run unpatched on plain input_ids and patch() accepts it). `window_active` says
whether the configured window reached the attention (False: the mask has it but the
attention does not; "unused by the model": neither does), so "exact" means the feature was
exercised.

Run:  PYTHONPATH=. python benchmarks/zoo.py                     (all 189: ~5 min on 2 idle cores, ~25 min loaded)
      PYTHONPATH=. python benchmarks/zoo.py --only llama,jamba     (a subset)
      PYTHONPATH=. python benchmarks/zoo.py --json out.json --markdown benchmarks/results/zoo.md   (README summary)
      PYTHONPATH=. python benchmarks/zoo.py --from-json out.json --markdown   (the table again, no run)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

from benchmarks.zoo_configs import CHUNK, WINDOW, tiny_config  # noqa: F401 -- re-exported for tests

DOCS = [13, 30, 9, 20]  # every document longer than WINDOW and CHUNK; 30 spans both shards
LOSS_TOL, GRAD_TOL = 1e-6, 1e-4
MESHES = {"ulysses2": (2, 1), "ring2": (1, 2)}


def _first_lines(e: Exception) -> str:
    """The cause of an exception in one line (a validation error names it on its second line)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return " ".join(lines[:2])[:240] or repr(e)[:240]


def packed_batch(vocab: int, docs=DOCS) -> dict:
    from transformers import DataCollatorWithFlattening

    g = torch.Generator().manual_seed(0)
    feats = [{"input_ids": torch.randint(3, vocab, (n,), generator=g).tolist()} for n in docs]
    return DataCollatorWithFlattening(return_position_ids=True, return_tensors="pt")(feats)


def _grads(model) -> dict:
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters() if p.requires_grad}


def reference(model, batch: dict, per_document: bool):
    """Unpatched loss and gradients; per_document=True runs the documents one at a time with
    the packed batch's normaliser (the sum of their token losses / all valid labels)."""
    model.zero_grad(set_to_none=True)
    if not per_document:
        loss = model(**batch, use_cache=False).loss
    else:
        ids, pos = batch["input_ids"][0], batch["position_ids"][0]
        starts = (pos == 0).nonzero().flatten().tolist() + [ids.numel()]
        n_total = sum(b - a - 1 for a, b in zip(starts, starts[1:]))
        loss = 0
        for a, b in zip(starts, starts[1:]):
            out = model(input_ids=ids[a:b][None], labels=ids[a:b][None], use_cache=False)
            loss = loss + out.loss * (b - a - 1) / n_total
    loss.backward()
    return loss.detach(), _grads(model)


def _errors(ref_loss, ref_grads, loss, grads) -> tuple[float, float, str]:
    lerr = abs(loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-30)
    top = max((g.abs().max().item() for g in ref_grads.values() if g.numel()), default=0.0) or 1e-30
    worst, name = 0.0, ""
    for n, g in ref_grads.items():
        e = (grads[n] - g).abs().max().item() / top if g.numel() else 0.0
        if e > worst:
            worst, name = e, n
    return lerr, worst, name


def run_arch(model_type: str, root: str, meshes: dict) -> dict:
    """One architecture on this rank (a pool task: both ranks run it in lockstep)."""
    import torch.distributed as dist
    import transformers as tf

    from hf_longctx import global_loss, patch, shard_batch, sum_gradients, unpatch
    from hf_longctx.integrations.attention import mask_implied_window
    from tests.helpers.pool import worker_mesh

    tf.utils.logging.disable_progress_bar()
    tf.utils.logging.set_verbosity_error()
    row = {"model_type": model_type, "features": {}}
    try:
        cfg = tiny_config(tf.CONFIG_MAPPING[model_type])
        torch.manual_seed(0)
        path = os.path.join(root, model_type)
        # through the Auto class, as a user would: a composite config mapped to a text-only
        # causal LM (qwen4_exp -> Qwen4ExpForCausalLM) is swapped for its text config there
        auto = tf.AutoModelForCausalLM
        built = auto.from_config(cfg, dtype=torch.float32)  # every rank builds (same seed): a failure is on all ranks
        if dist.get_rank() == 0:  # transformers' save_pretrained writes the weights from the main process only
            built.save_pretrained(path)
        dist.barrier()
        # reloaded by the built class: a text config that Auto swapped in (Emu3TextConfig) is not
        # itself registered for AutoModelForCausalLM
        mode = {"train": True}
        load = lambda: type(built).from_pretrained(path, dtype=torch.float32).train(mode["train"])  # noqa: E731
        model = load()
    except Exception as e:  # noqa: BLE001
        row["verdict"] = {m: "SKIP" for m in meshes}
        row["reason"] = f"{type(e).__name__}: {_first_lines(e)}"
        return row
    ref_error = None
    try:
        # token ids the LM head predicts (CPM-Ant's embedding also holds its prompt tokens)
        vocab = min(model.get_input_embeddings().num_embeddings, getattr(model.config.get_text_config(), "vocab_size", None) or 1 << 30)
        batch = packed_batch(vocab)
        torch.manual_seed(1)
        packed = reference(model, batch, per_document=False)
        torch.manual_seed(2)
        again = _errors(*packed, *reference(model, batch, per_document=False))
        if again[0] > LOSS_TOL / 100 or again[1] > GRAD_TOL / 100:  # a deterministic model repeats itself bit for bit
            # random in training mode beyond dropout (PhiMoE samples its experts): no two runs agree,
            # so SP and its reference are compared in eval mode (the same arithmetic, gradients too)
            row["features"]["train_mode_random"] = True
            mode["train"] = False
            model.eval()
            packed = reference(model, batch, per_document=False)
        alone = reference(model, batch, per_document=True)
        leaks = _errors(alone[0], alone[1], *packed)
        row["own_path_leaks"] = leaks[0] > LOSS_TOL or leaks[1] > GRAD_TOL
        ref_loss, ref_grads = alone if row["own_path_leaks"] else packed
    except Exception as e:  # noqa: BLE001 -- cannot run on plain input_ids: SKIP, unless patch() refuses it anyway
        ref_error = f"{type(e).__name__}: {_first_lines(e)}"
    for text in [c for c in (cfg, getattr(cfg, "text_config", None)) if c is not None]:
        for feat, val in (("window", getattr(text, "sliding_window", None)), ("chunk", getattr(text, "attention_chunk_size", None))):
            if isinstance(val, int) and val > 0:
                row["features"][feat] = val
    row["verdict"], row["errors"] = {}, {}
    for mname, (u, r) in meshes.items():
        mesh = worker_mesh(u, r)
        model = load()
        try:
            patch(model, mesh)
        except Exception as e:  # noqa: BLE001
            row["verdict"][mname] = "REFUSED"
            msg = str(getattr(e, "what", e)).split("\n- ")  # a NotSupported's obstacle, without its do-instead line
            row["reason"] = (msg[1] if len(msg) > 1 else msg[0]).strip()[:400]
            continue
        if ref_error is not None:  # accepted by patch() but no unpatched reference to compare with
            row["verdict"][mname], row["reason"] = "SKIP", ref_error
            unpatch(model)
            continue
        probe = model._hf_longctx_patch.probe
        if probe is not None and "window" in row["features"]:
            w = row["features"]["window"]
            # a window the config carries but neither the mask nor the attention uses (Moshi) is no feature of the model
            row["features"]["window_active"] = (
                True if w in probe.windows_attention or mask_implied_window(probe.mask_windows) == w
                else False if w in probe.windows_mask else "unused by the model"
            )
        try:
            model.zero_grad(set_to_none=True)
            out = model(**shard_batch(batch, mesh))
            out.loss.backward()
            for p in model.parameters():  # an unused parameter must not skip the all-reduce on one rank only
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
            sum_gradients(model.parameters(), mesh)
            lerr, gerr, worst = _errors(ref_loss, ref_grads, global_loss(out.loss, mesh), _grads(model))
        except Exception as e:  # noqa: BLE001
            row["verdict"][mname] = "CRASH"
            row["reason"] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        row["errors"][mname] = (lerr, gerr, worst)
        row["verdict"][mname] = "EXACT" if lerr <= LOSS_TOL and gerr <= GRAD_TOL else "WRONG"
        if row["verdict"][mname] == "WRONG":
            row["reason"] = f"loss rel {lerr:.1e}, grad {gerr:.1e} (worst {worst})"
    return row


def overall(row: dict) -> str:
    vs = set(row["verdict"].values())
    for v in ("CRASH", "WRONG", "SKIP", "REFUSED", "EXACT"):
        if v in vs:
            return v
    return "CRASH"


def all_model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def run_zoo(types: list[str], timeout: float = 240.0, pool=None, log=print) -> list[dict]:
    from tests.helpers.pool import GlooPool

    own = pool is None
    pool = pool or GlooPool(2)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hf_longctx_zoo_") as root:
        for t in types:
            start = time.time()
            try:
                row = pool.run(run_arch, t, root, MESHES, timeout=timeout)[0]
            except Exception as e:  # noqa: BLE001 -- a hang or a rank-local failure: a fresh pool for the next one
                row = {"model_type": t, "verdict": {m: "CRASH" for m in MESHES}, "reason": f"{type(e).__name__}: {str(e)[-300:]}", "features": {}}
                pool.close()
                pool = GlooPool(2)
                own = True
            row["seconds"] = round(time.time() - start, 1)
            broken = "gloo" in row.get("reason", "") or "Connection closed" in row.get("reason", "")
            if broken:  # a rank died (not the model's fault): retry once on a fresh pool
                pool.close()
                pool = GlooPool(2)
                own = True
                try:
                    row = pool.run(run_arch, t, root, MESHES, timeout=timeout)[0]
                except Exception as e:  # noqa: BLE001
                    row = {"model_type": t, "verdict": {m: "CRASH" for m in MESHES}, "reason": f"{type(e).__name__}: {str(e)[-300:]}", "features": {}}
            if "CRASH" in row["verdict"].values() or broken:  # a collective may have been left half-done
                pool.close()
                pool = GlooPool(2)
                own = True
            rows.append(row)
            log(line(row))
    if own:
        pool.close()
    return rows


def line(row: dict) -> str:
    feats = ",".join(f"{k}={v}" for k, v in row.get("features", {}).items())
    verdicts = " ".join(f"{m}:{v}" for m, v in row["verdict"].items())
    return f"{row['model_type']:28s} {overall(row):8s} {verdicts:36s} {feats:40s} {row.get('reason', '')}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(rows: list[dict], command: str = "") -> str:
    """The README summary (verdict counts with the architectures) and the per-architecture table."""
    import transformers

    groups: dict = {}
    for r in rows:
        groups.setdefault(overall(r), []).append(r["model_type"])
    out = [
        f"Measured by `benchmarks/zoo.py` on transformers {transformers.__version__}, torch {torch.__version__} "
        f"(CPU, 2 gloo ranks, fp32){f': `{command}`' if command else ''}. EXACT: loss <= {LOSS_TOL:g} relative and every "
        f"gradient within {GRAD_TOL:g} of the largest reference gradient, on Ulysses 2 and on ring 2.",
        "",
        "| verdict | count | architectures (transformers model_type) |",
        "|---|---|---|",
    ]
    for v in ("EXACT", "REFUSED", "WRONG", "CRASH", "SKIP"):
        names = sorted(groups.get(v, []))
        out.append(f"| {v} | {len(names)} | {', '.join(names)} |")
    out += ["", "| model_type | verdict | " + " | ".join(MESHES) + " | features | reason |", "|---|---|" + "---|" * len(MESHES) + "---|---|"]
    for r in sorted(rows, key=lambda r: r["model_type"]):
        cells = []
        for m in MESHES:
            v = r["verdict"].get(m, "")
            err = (r.get("errors") or {}).get(m)
            cells.append(f"{v} ({err[0]:.0e} / {err[1]:.0e})" if err and v in ("EXACT", "WRONG") else v)
        feats = ", ".join(f"{k}={v}" for k, v in r.get("features", {}).items())
        out.append(f"| {r['model_type']} | {overall(r)} | " + " | ".join(cells) + f" | {_cell(feats)} | {_cell(r.get('reason', ''))} |")
    return "\n".join(out)


def merged_rows(paths: str) -> list[dict]:
    """The rows of earlier --json runs (comma-separated files): a later file's row replaces an
    earlier one's (a re-run after a fix), sorted by model type."""
    merged: dict = {}
    for path in paths.split(","):
        with open(path) as f:
            merged.update({r["model_type"]: r for r in json.load(f)})
    return [merged[t] for t in sorted(merged)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated model types (default: all)")
    ap.add_argument("--timeout", type=float, default=240.0, help="per-model seconds before CRASH (hang)")
    ap.add_argument("--json", default="", help="write the rows here")
    ap.add_argument("--markdown", nargs="?", const="-", default="", help="write the README summary and per-architecture table (to stdout, or to this file)")
    ap.add_argument("--from-json", default="", help="do not run: read the rows of earlier --json runs (comma-separated; later ones win)")
    args = ap.parse_args()
    if args.from_json:
        rows = merged_rows(args.from_json)
    else:
        types = [t for t in args.only.split(",") if t] or all_model_types()
        rows = run_zoo(types, timeout=args.timeout, log=lambda s: print(s, flush=True))
    counts = {v: sum(overall(r) == v for r in rows) for v in ("EXACT", "REFUSED", "WRONG", "CRASH", "SKIP")}
    print("summary:", counts)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    if args.markdown:
        text = markdown(rows, "python benchmarks/zoo.py" + (f" --only {args.only}" if args.only else ""))
        if args.markdown == "-":
            print(text)
        else:
            os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
            with open(args.markdown, "w") as f:
                f.write(text + "\n")
    sys.exit(1 if counts["WRONG"] or counts["CRASH"] else 0)


if __name__ == "__main__":
    main()
