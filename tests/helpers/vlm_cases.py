"""Tiny vision-language models and packed multimodal rows for the VLM tests and benchmarks.

Builders for Qwen2.5-VL, Qwen3-VL (DeepStack), Gemma 3 (sliding windows), Qwen3.5 (Gated
DeltaNet hybrid) and LLaVA (CLIP tower) from their config classes (no hub), synthetic images and short videos made
locally, documents as a processor makes them (placeholders expanded, wrapped in the family's
start/end tokens), and the single-process reference: the documents run ONE AT A TIME
through transformers' own path (the model computes its own M-RoPE positions and merges its
own images), losses weighted by their valid targets over the row's total -- independent of
everything `shard_multimodal` does.
"""

from __future__ import annotations

import torch

VOCAB = 160
IMAGE, VIDEO, START, END = 150, 151, 152, 153
TEXT_HI = 140  # text tokens are drawn from [3, TEXT_HI)
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "gemma3", "qwen3_5")


def vlm_config(family: str):
    import transformers as tf

    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    qvis = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32, patch_size=2,
                spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    mrope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    if family == "qwen2_5_vl":  # window attention in block 0 (window 8 px = 2x2 merged tokens), full in block 1
        return tf.Qwen2_5_VLConfig(text_config={**text, "rope_parameters": mrope},
                                   vision_config={**qvis, "window_size": 8, "fullatt_block_indexes": [1]}, **ids)
    if family == "qwen3_vl":  # DeepStack from vision block 0
        return tf.Qwen3VLConfig(text_config={**text, "head_dim": 8, "rope_parameters": mrope},
                                vision_config={**qvis, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]}, **ids)
    if family == "qwen3_5":  # Gated DeltaNet, attention, Gated DeltaNet
        gdn = dict(linear_key_head_dim=4, linear_value_head_dim=4, linear_conv_kernel_dim=4, linear_num_key_heads=2,
                   linear_num_value_heads=4, layer_types=["linear_attention", "full_attention", "linear_attention"])
        return tf.Qwen3_5Config(
            text_config={**text, "num_hidden_layers": 3, "head_dim": 8, **gdn,
                         "rope_parameters": {**mrope, "partial_rotary_factor": 1.0}},
            vision_config={**qvis, "num_position_embeddings": 16}, **ids)
    if family == "gemma3":  # 16x16 images, 4x4 patches pooled to 2x2 = 4 tokens; layer 0 sliding (window 6)
        return tf.Gemma3Config(
            text_config={**text, "head_dim": 8, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"],
                         "query_pre_attn_scalar": 8},
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               image_size=16, patch_size=4, vision_use_head=False),
            mm_tokens_per_image=4, image_token_index=IMAGE, boi_token_index=START, eoi_token_index=END,
        )
    if family == "llava":  # CLIP 16x16 images, 4x4 patches: 16 tokens (the CLS token dropped, "default")
        return tf.LlavaConfig(
            text_config={**text, "model_type": "llama"},
            vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, image_size=16, patch_size=4, projection_dim=32),
            image_token_index=IMAGE, vision_feature_layer=-1,
        )
    raise KeyError(family)


def build(family: str, seed: int = 0):
    """The tiny model, fp32, train mode, every dropout 0 (the config defaults)."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = vlm_config(family)
    cls = {"qwen2_5_vl": tf.Qwen2_5_VLForConditionalGeneration, "qwen3_vl": tf.Qwen3VLForConditionalGeneration,
           "qwen3_5": tf.Qwen3_5ForConditionalGeneration, "gemma3": tf.Gemma3ForConditionalGeneration,
           "llava": tf.LlavaForConditionalGeneration}[family]
    model = cls(cfg).float().train()
    if family == "gemma3":  # its projection starts at zero (no gradient would reach the tower): a trained-like one
        with torch.no_grad():
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2)
    return model


PATCH_DIM = 3 * 2 * 2 * 2  # C · temporal patch · patch · patch of the Qwen towers


def document(family: str, g: torch.Generator, n_text: int, images=(), videos=()) -> dict:
    """One document as the processor makes it: text, then each image (a (t, h, w) grid for the
    Qwen families, ignored by Gemma 3: 16x16 pixels) and video wrapped in start/end tokens."""
    grid_family = family not in ("gemma3", "llava")
    per_image = 16 if family == "llava" else 4
    ids = [torch.randint(3, TEXT_HI, (n_text,), generator=g)]
    out: dict = {}
    pix, grids, vpix, vgrids = [], [], [], []
    for t, h, w in images:
        n = t * h * w // 4 if grid_family else per_image
        ids += [torch.tensor([START]), torch.full((n,), IMAGE), torch.tensor([END]), torch.randint(3, TEXT_HI, (3,), generator=g)]
        pix.append(torch.randn(t * h * w, PATCH_DIM, generator=g) if grid_family else torch.randn(1, 3, 16, 16, generator=g))
        grids.append([t, h, w])
    for t, h, w in videos:
        if family in ("qwen3_vl", "qwen3_5"):  # each temporal slice after its timestamp text, in its own start/end
            for _ in range(t):
                ids += [torch.randint(3, TEXT_HI, (2,), generator=g), torch.tensor([START]), torch.full((h * w // 4,), VIDEO),
                        torch.tensor([END])]
        else:
            ids += [torch.tensor([START]), torch.full((t * h * w // 4,), VIDEO), torch.tensor([END])]
        ids.append(torch.randint(3, TEXT_HI, (2,), generator=g))
        vpix.append(torch.randn(t * h * w, PATCH_DIM, generator=g))
        vgrids.append([t, h, w])
    out["input_ids"] = torch.cat(ids)
    if pix:
        out["pixel_values"] = torch.cat(pix)
        if grid_family:
            out["image_grid_thw"] = torch.tensor(grids)
    if vpix:
        out["pixel_values_videos"] = torch.cat(vpix)
        out["video_grid_thw"] = torch.tensor(vgrids)
    return out


def mixed_documents(family: str, seed: int = 0) -> list[dict]:
    """A packed row's worth: text-only documents, several images of different sizes, and (Qwen
    families with video) a 3-slice video; one image straddles shard boundaries on every mesh."""
    g = torch.Generator().manual_seed(seed)
    video = [(3, 4, 4)] if family not in ("gemma3", "llava") else []
    return [
        document(family, g, 5, images=[(1, 4, 4)]),
        document(family, g, 9),
        document(family, g, 4, images=[(1, 4, 8), (1, 8, 4)], videos=video),
        document(family, g, 7),
    ]


GRID_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def packed_row(docs: list[dict]) -> dict:
    """The documents as one packed row (B = 1, positions restarting per document), labels = ids."""
    ids = torch.cat([d["input_ids"] for d in docs])[None]
    out = {"input_ids": ids, "labels": ids.clone(),
           "position_ids": torch.cat([torch.arange(len(d["input_ids"])) for d in docs])[None]}
    for k in GRID_KEYS:
        parts = [d[k] for d in docs if k in d]
        if parts:
            out[k] = torch.cat(parts)
    return out


def labels_of(ids: torch.Tensor) -> torch.Tensor:
    lab = ids.clone()
    lab[(ids == IMAGE) | (ids == VIDEO)] = -100
    return lab


def reference(model, docs: list[dict], backward: bool = True):
    """Loss (and gradients) of the documents one at a time through transformers' own path."""
    loss, grads, _ = reference_tokens(model, docs, backward)
    return loss, grads


def reference_tokens(model, docs: list[dict], backward: bool = True):
    """`reference` plus the per-target losses [N] (float64, document order: each document's
    targets in sequence order, image tokens excluded), from the model's logits."""
    model.zero_grad(set_to_none=True)
    labs = [labels_of(d["input_ids"]) for d in docs]
    total = sum(int((lab[1:] != -100).sum()) for lab in labs)
    loss, tokens = 0, []
    for d, lab in zip(docs, labs):
        ids = d["input_ids"][None]
        kw = {k: v for k, v in d.items() if k != "input_ids"}
        if "image_grid_thw" in kw or "video_grid_thw" in kw:
            mm = torch.zeros_like(ids)
            mm[ids == IMAGE], mm[ids == VIDEO] = 1, 2
            kw["mm_token_type_ids"] = mm
        out = model(input_ids=ids, labels=lab[None], use_cache=False, **kw)
        loss = loss + out.loss * int((lab[1:] != -100).sum()) / total
        keep = lab[1:] != -100  # [L-1]: the target of position t is lab[t + 1]
        logits = out.logits[0, :-1].detach()  # [L-1, V]; bf16 under autocast: cross-entropy in fp32, as the loss
        logits = logits if logits.dtype == torch.float64 else logits.float()
        ce = torch.nn.functional.cross_entropy(logits, lab[1:], ignore_index=-100, reduction="none")
        tokens.append(ce[keep].double())
    if backward:
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, torch.cat(tokens)


def row_targets(docs: list[dict]) -> torch.Tensor:
    """The packed row's unshifted labels [1, S] with -100 at every document's first token too,
    so that a shift by one never crosses documents (`bf16_rule.token_losses` order)."""
    labs = [labels_of(d["input_ids"]) for d in docs]
    for lab in labs:
        lab[0] = -100
    return torch.cat(labs)[None]


def double(docs: list[dict]) -> list[dict]:
    return [{k: (v.double() if v.is_floating_point() else v) for k, v in d.items()} for d in docs]


def rel(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    """max|a - b| / max|b|; `floor` bounds the denominator below (a gradient that is zero in
    exact arithmetic, e.g. of an attention key bias, is then judged against the model's scale)."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(floor)).item()


LOSS_TOL, GRAD_TOL = 1e-5, 1e-4


def compare(ref32, ref64, loss, grads) -> dict:
    """Errors of an fp32 SP run against the float64 truth (the documents one by one), each as a
    fraction of its allowance (<= 1 passes): loss 1e-5, a gradient 1e-4 -- widened to twice the
    single-process fp32 error against the same truth where that is larger (a gradient summed
    with cancellation, e.g. a Gated DeltaNet decay, carries more fp32 rounding than 1e-4 of its
    own size on one process too). Per part: language model, projector, vision tower; `ref_max`
    (the largest reference gradient of each part) shows that the part was exercised. A gradient
    is measured against its own largest entry, floored at 1e-3 of the model's largest gradient (an
    exactly-zero gradient, such as an attention key bias's, is fp32 noise of ~1e-9 of that scale)."""
    (l32, g32), (l64, g64) = ref32, ref64
    errs = {"loss": rel(loss, l64) / max(LOSS_TOL, 2 * rel(l32, l64)), "missing": sorted(set(g64) ^ set(grads))}
    floor = 1e-3 * max(g.abs().max().item() for g in g64.values())
    for part in ("language", "projector", "vision"):
        names = [n for n in g64 if _part(n) == part and n in grads]
        errs[part] = max(
            (rel(grads[n], g64[n], floor) / max(GRAD_TOL, 2 * rel(g32[n], g64[n], floor)) for n in names), default=0.0
        )
        errs[part + "_max"] = max((g64[n].abs().max().item() for n in names), default=0.0)
    return errs


def references(family: str, docs: list[dict]):
    """(fp32, float64) single-process references of `family`'s tiny model on `docs`."""
    return reference(build(family), docs), reference(build(family).double(), double(docs))


def _part(name: str) -> str:
    if "merger" in name or "multi_modal_projector" in name:
        return "projector"
    if ".visual." in name or "vision_tower" in name:
        return "vision"
    return "language"
