"""The classification of every image-text-to-text model of the installed transformers, measured.

Where it sits: outside the library; it drives the public path (`patch`, `vision_spec`,
`shard_multimodal`, `global_loss`, `sum_gradients`) on 2 gloo ranks (tests/helpers/pool.py) for every
model type of `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`, and prints the table the README
and `integrations/vision/classification.py` carry:

1. build it tiny (`tests/helpers/vlm_cases.vlm_config` for the families the tests use, else
   `benchmarks/zoo_configs.tiny_config` with its image/video token ids moved into the tiny
   vocabulary);
2. the structural causes first: an encoder-decoder, cross-attention to image states, no
   pre-encoded input path (`mm_encoder_outputs`), a language model `patch()` refuses;
3. the adapter (the library's, or for an unlisted Qwen-style family -- `image_grid_thw` and
   `get_image_features(pixels, grid)` -- the generic `GridFamily` as a candidate): a packed row of
   documents (text only, two images of different sizes, a video where the family has one)
   through `patch` + `shard_multimodal` on Ulysses 2 and on ring 2, against the documents
   run one at a time through transformers' own path.

Verdicts: EXACT (loss <= 1e-5 relative, every gradient within 1e-4 of the largest reference
gradient, on both meshes; `candidate` when the library does not list it yet), REFUSED (the
cause), WRONG (it ran and differs: the cause for the table), CRASH (anything else).

Run:  PYTHONPATH=. python benchmarks/vlm_zoo.py [--only qwen2_5_vl,gemma3] [--json out.json] [--markdown out.md]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import tempfile
import time

import torch

from benchmarks.zoo import _errors, merged_rows  # the zoo's criterion: loss relative, gradients against the largest

MESHES = {"ulysses2": (2, 1), "ring2": (1, 2)}
LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
TEXT_HI = 96  # text tokens are drawn from [3, TEXT_HI); special tokens move to [100, 128)


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(getattr(e, "what", e)).splitlines() if ln.strip()]
    text = " ".join(lines[:2]) if lines else repr(e)
    return f"{type(e).__name__}: {text}"[:300]


def tiny(model_type: str):
    import transformers as tf

    from tests.helpers.vlm_cases import vlm_config

    try:
        return vlm_config(model_type)
    except KeyError:
        pass
    if model_type == "shieldgemma2":  # Gemma 3's class under its own config type: the Gemma 3 test config
        fields = vlm_config("gemma3").to_dict()
        fields.pop("model_type", None)
        return tf.ShieldGemma2Config(**fields)
    from benchmarks.zoo_configs import tiny_config

    cfg = tiny_config(tf.CONFIG_MAPPING[model_type])
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if getattr(text, "use_sliding_window", None):  # the zoo's switch; released VL checkpoints leave it off
        text.use_sliding_window = False
    rope = getattr(text, "rope_parameters", None)
    if isinstance(rope, dict) and "rope_type" in rope:  # M-RoPE sections sized to head_dim 8 (4 frequencies)
        rope["mrope_section"] = [2, 1, 1]
    vision = getattr(cfg, "vision_config", None)
    if vision is not None and getattr(vision, "deepstack_visual_indexes", None):  # DeepStack from the tiny tower's block 0
        vision.deepstack_visual_indexes = [0]
    for key in ("out_hidden_size", "projection_dim", "text_hidden_size"):  # the tower's output feeds the language model
        if vision is not None and isinstance(getattr(vision, key, None), int):
            setattr(vision, key, text.hidden_size)
    vocab = cfg.get_text_config().vocab_size if hasattr(cfg, "get_text_config") else 128
    free = iter(range(100, 128))
    for key, value in sorted(cfg.to_dict().items()):
        if (key.endswith("_token_id") or key.endswith("_token_index")) and isinstance(value, int) and value >= vocab:
            try:
                setattr(cfg, key, next(free))
            except Exception:  # noqa: BLE001 -- a read-only alias
                pass
    return cfg


def structural_cause(model) -> str | None:
    """A cause visible from the class alone, or None."""
    cfg = model.config
    params = inspect.signature(type(model).forward).parameters
    if getattr(cfg, "is_encoder_decoder", False) or "decoder_input_ids" in params:
        return "encoder-decoder: the text decoder cross-attends to an encoder's states, not one causal sequence"
    if "cross_attention_states" in params or "image_encoder_embeddings" in params:
        return "cross-attention layers read the image states from every text position (a text shard needs every image key)"
    if "mm_encoder_outputs" not in params:
        return "its forward takes no pre-encoded image features (mm_encoder_outputs): images cannot be encoded on one rank and merged on another"
    if not callable(getattr(model, "get_image_features", None)):
        return "no get_image_features: its image path cannot be called per image"
    return None


def candidate(model, model_type: str):
    """(adapter, listed): the library's adapter, or the generic grid adapter for an unlisted
    Qwen-style family, or (None, False)."""
    from hf_longctx.integrations.vision.classification import ADAPTERS
    from hf_longctx.integrations.vision.families import GridFamily

    if model_type in ADAPTERS:
        return ADAPTERS[model_type], True
    params = inspect.signature(type(model).forward).parameters
    gif = list(inspect.signature(model.get_image_features).parameters)
    if "image_grid_thw" in params and gif[:2] == ["pixel_values", "image_grid_thw"] and hasattr(model.config, "vision_config"):
        return GridFamily(model_type), False
    return None, False


def _patch_dim(vcfg) -> int:
    c = getattr(vcfg, "in_channels", None) or getattr(vcfg, "num_channels", None) or 3
    t = getattr(vcfg, "temporal_patch_size", None) or 1
    p = vcfg.patch_size
    return int(c) * int(t) * int(p) * int(p)


def documents(model, spec, per_frame: bool) -> list[dict]:
    """Text-only documents, two images of different sizes, and a 2-slice video if the family has one."""
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    start = getattr(cfg, "vision_start_token_id", None)
    end = getattr(cfg, "vision_end_token_id", None)
    wrap = (lambda x: [torch.tensor([start]), x, torch.tensor([end])]) if start is not None and end is not None else (lambda x: [x])
    text = lambda n: torch.randint(3, TEXT_HI, (n,), generator=g)  # noqa: E731
    m = spec.merge
    docs = []
    for images, video in (([(1, 2 * m, 2 * m)], None), ([], None), ([(1, 2 * m, 4 * m), (1, 4 * m, 2 * m)], (2, 2 * m, 2 * m)), ([], None)):
        ids, out, pix, grids = [text(5)], {}, [], []
        for grid in images:
            if spec.layout == "grid":
                ids += wrap(torch.full((spec.item_tokens(grid),), spec.modalities[0].token_id)) + [text(2)]
                pix.append(torch.randn(grid[0] * grid[1] * grid[2], _patch_dim(cfg.vision_config), generator=g))
                grids.append(list(grid))
            else:
                ids += wrap(torch.full((spec.tokens_per_item,), spec.modalities[0].token_id)) + [text(2)]
                size = cfg.vision_config.image_size
                pix.append(torch.randn(1, 3, size, size, generator=g))
        if pix:
            out["pixel_values"] = torch.cat(pix)
            if grids:
                out["image_grid_thw"] = torch.tensor(grids)
        if video is not None and len(spec.modalities) > 1:
            vm = spec.modalities[1]
            t, h, w = video
            if per_frame:
                for _ in range(t):
                    ids += [text(2)] + wrap(torch.full((h * w // (m * m),), vm.token_id))
            else:
                ids += wrap(torch.full((spec.item_tokens(video),), vm.token_id))
            ids.append(text(2))
            out["pixel_values_videos"] = torch.randn(t * h * w, _patch_dim(cfg.vision_config), generator=g)
            out["video_grid_thw"] = torch.tensor([list(video)])
        out["input_ids"] = torch.cat(ids)
        docs.append(out)
    return docs


def reference(model, docs: list[dict], spec) -> tuple:
    params = inspect.signature(type(model).forward).parameters
    model.zero_grad(set_to_none=True)
    labels = []
    for d in docs:
        lab = d["input_ids"].clone()
        for m in spec.modalities:
            lab[d["input_ids"] == m.token_id] = -100
        labels.append(lab)
    total = sum(int((lab[1:] != -100).sum()) for lab in labels)
    loss = 0
    for d, lab in zip(docs, labels):
        ids = d["input_ids"][None]
        kw = {k: v for k, v in d.items() if k != "input_ids"}
        if "mm_token_type_ids" in params:
            mm = torch.zeros_like(ids)
            for m in spec.modalities:
                mm[ids == m.token_id] = m.type_id
            kw["mm_token_type_ids"] = mm
        out = model(input_ids=ids, labels=lab[None], use_cache=False, **kw)
        loss = loss + out.loss * int((lab[1:] != -100).sum()) / total
    loss.backward()
    return loss.detach(), {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def run_type(model_type: str, root: str) -> dict:
    """One model type on this rank (a pool task: both ranks run it in lockstep)."""
    import transformers as tf
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as NAMES

    from hf_longctx import global_loss, patch, sum_gradients, unpatch
    from hf_longctx.data.multimodal.sharding import shard_multimodal
    from tests.helpers.pool import worker_mesh

    tf.utils.logging.set_verbosity_error()
    row = {"model_type": model_type, "class": NAMES[model_type], "verdict": "CRASH", "errors": {}}
    try:
        cfg = tiny(model_type)
        torch.manual_seed(0)
        model = getattr(tf, NAMES[model_type])(cfg).float().train()
    except Exception as e:  # noqa: BLE001
        row.update(verdict="REFUSED", reason=f"no tiny model could be built to check it ({_first_line(e)}); refused until measured")
        return row
    if model_type == "gemma3" or type(model).__name__ == "Gemma3ForConditionalGeneration":
        with torch.no_grad():
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2)
    cause = structural_cause(model)
    if cause:
        row.update(verdict="REFUSED", reason=cause)
        return row
    state = {k: v.clone() for k, v in model.state_dict().items()}
    mesh = worker_mesh(1, 1)
    try:
        patch(model, mesh)
        unpatch(model)
    except Exception as e:  # noqa: BLE001
        row.update(verdict="REFUSED", reason=f"its language model is refused by patch(): {_first_line(e)}")
        return row
    adapter, listed = candidate(model, model_type)
    if adapter is None:
        pix = sorted(k for k in inspect.signature(type(model).forward).parameters if "pixel" in k or "image" in k or "grid" in k)
        row.update(verdict="REFUSED", reason=f"no adapter for its image inputs ({', '.join(pix)}): token count per image and encoder call not modelled")
        return row
    row["listed"] = listed
    if not listed:  # measured as a candidate: registered in this worker only, for this run
        from hf_longctx.integrations.vision import classification

        classification.ADAPTERS[model_type] = adapter
    try:
        spec = adapter.spec(model)
    except Exception as e:  # noqa: BLE001
        row.update(verdict="REFUSED", reason=f"no adapter: the Qwen-style grid contract does not fit ({_first_line(e)})")
        return row
    ref = docs = None
    for per_frame in (False, True):
        try:
            docs = documents(model, spec, per_frame)
            ref = reference(model, docs, spec)
            break
        except Exception as e:  # noqa: BLE001
            row["reason"] = f"no adapter: the adapter's image inputs do not run the unpatched model ({_first_line(e)})"
    if ref is None:
        row["verdict"] = "REFUSED"
        return row
    row.pop("reason", None)
    verdicts = {}
    for name, (u, r) in MESHES.items():
        mesh = worker_mesh(u, r)
        model.load_state_dict(state)
        try:
            patch(model, mesh)
            model.zero_grad(set_to_none=True)
            shard = shard_multimodal(dict(_packed(docs)), mesh, spec)
            out = model(**shard)
            out.loss.backward()
            for p in model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
            sum_gradients(model.parameters(), mesh)
            errs = _errors(*ref, global_loss(out.loss, mesh), {n: p.grad for n, p in model.named_parameters()})
        except Exception as e:  # noqa: BLE001
            verdicts[name] = "CRASH"
            row["reason"] = _first_line(e)
            unpatch(model)
            continue
        unpatch(model)
        row["errors"][name] = errs
        verdicts[name] = "EXACT" if errs[0] <= LOSS_TOL and errs[1] <= GRAD_TOL else "WRONG"
        if verdicts[name] == "WRONG":
            row["reason"] = f"loss rel {errs[0]:.1e}, grad {errs[1]:.1e} (worst {errs[2]})"
    vs = set(verdicts.values())
    row["verdict"] = "CRASH" if "CRASH" in vs else "WRONG" if "WRONG" in vs else "EXACT"
    return row


def _packed(docs: list[dict]) -> dict:
    out = {"input_ids": torch.cat([d["input_ids"] for d in docs])[None]}
    out["labels"] = out["input_ids"].clone()
    out["position_ids"] = torch.cat([torch.arange(len(d["input_ids"])) for d in docs])[None]
    for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        parts = [d[k] for d in docs if k in d]
        if parts:
            out[k] = torch.cat(parts)
    return out


def all_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def run_all(types: list[str], timeout: float = 240.0, log=print) -> list[dict]:
    from tests.helpers.pool import GlooPool

    pool = GlooPool(2)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hf_longctx_vlm_zoo_") as root:
        for t in types:
            start = time.time()
            try:
                row = pool.run(run_type, t, root, timeout=timeout)[0]
            except Exception as e:  # noqa: BLE001 -- a hang or a rank-local failure: a fresh pool for the next one
                row = {"model_type": t, "verdict": "CRASH", "reason": f"{type(e).__name__}: {str(e)[-300:]}", "errors": {}}
                pool.close()
                pool = GlooPool(2)
            row["seconds"] = round(time.time() - start, 1)
            rows.append(row)
            log(f"{t:26s} {row['verdict']:8s} {row.get('reason', '')[:160]}")
    pool.close()
    return rows


def markdown(rows: list[dict]) -> str:
    import transformers

    counts: dict = {}
    for r in rows:
        counts.setdefault(r["verdict"], []).append(r["model_type"])
    out = [
        f"Measured by `benchmarks/vlm_zoo.py` on transformers {transformers.__version__}, torch {torch.__version__} "
        f"(CPU, 2 gloo ranks, fp32). EXACT: a packed row of text-only documents, two images of different sizes and a "
        f"video (where the family has one), loss <= {LOSS_TOL:g} relative and every gradient (language model, "
        f"projector, vision tower) within {GRAD_TOL:g} of the largest reference gradient, on Ulysses 2 and on ring 2.",
        "",
        "| verdict | count | model types |",
        "|---|---|---|",
    ]
    for v in ("EXACT", "REFUSED", "WRONG", "CRASH"):
        names = sorted(counts.get(v, []))
        out.append(f"| {v} | {len(names)} | {', '.join(names)} |")
    out += ["", "| model_type | class | verdict | cause / errors (loss, grad) |", "|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["model_type"]):
        errs = "; ".join(f"{m} {e[0]:.0e} / {e[1]:.0e}" for m, e in (r.get("errors") or {}).items())
        text = (r.get("reason") or errs).replace("|", "\\|")
        out.append(f"| {r['model_type']} | {r.get('class', '')} | {r['verdict']} | {text} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated model types (default: all)")
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--json", default="")
    ap.add_argument("--markdown", default="")
    ap.add_argument("--from-json", default="", help="do not run: read rows of earlier --json runs (later ones win)")
    args = ap.parse_args()
    if args.from_json:
        rows = merged_rows(args.from_json)
    else:
        rows = run_all([t for t in args.only.split(",") if t] or all_types(), args.timeout, log=lambda s: print(s, flush=True))
    print("summary:", {v: sum(r["verdict"] == v for r in rows) for v in ("EXACT", "REFUSED", "WRONG", "CRASH")})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(markdown(rows) + "\n")


if __name__ == "__main__":
    main()
