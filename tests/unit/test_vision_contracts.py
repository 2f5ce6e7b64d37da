"""CPU contracts of every adapted vision-language family against transformers' real API.

What the SP path relies on, per family (Qwen2.5-VL, Qwen3-VL, Gemma 3, Qwen3.5, LLaVA):
- separability: encoding items one by one (and a video slice by slice, where the adapter
  says so) gives the rows and DeepStack levels of encoding them together;
- the token rule: `VisionSpec.item_tokens` equals the rows the encoder returns per item;
- `mm_encoder_outputs` built the way the vision hook builds it (its container and output
  type) gives the model the same logits as `pixel_values`, also with a zero-row modality;
- a zero-row received tensor stays in the autograd graph (the exchange's backward runs on a
  rank that holds no image token);
- `patch()` switches only the language model's attention, leaves the tower's, and refuses
  raw pixels given to the patched model; `unpatch()` restores every config.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.vlm_cases import FAMILIES, build, mixed_documents, packed_row

ALL = (*FAMILIES, "llava")


def _spec_family(model):
    from hf_longctx.integrations.vision.registry import vision_family

    fam = vision_family(model)
    return fam, fam.spec(model)


def _items(spec, batch, mi):
    from hf_longctx.data.multimodal.items import read_row

    pos = batch["position_ids"][0]
    cu = [0, *((pos[1:] != pos[:-1] + 1).nonzero().flatten() + 1).tolist(), pos.numel()]
    vision = read_row(batch, batch["input_ids"][0], cu, spec)
    return vision, [u for u in vision.units if u.modality == mi]


@pytest.mark.parametrize("family", ALL)
def test_units_encode_alone_as_together(family):
    model = build(family).eval()
    fam, spec = _spec_family(model)
    batch = packed_row(mixed_documents(family))
    for mi, m in enumerate(spec.modalities):
        vision, units = _items(spec, batch, mi)
        if not units:
            continue
        pix = vision.pixels[mi]

        def inputs(us):
            out = {"pixels": torch.cat([pix[u.pixels[0]:u.pixels[1]] for u in us])}
            if spec.layout == "grid":
                out["grid"] = torch.tensor([u.grid for u in us])
            return out

        with torch.no_grad():
            whole = {"pixels": pix, "grid": torch.tensor([g for _, g in vision.items[mi]])} if spec.layout == "grid" else {"pixels": pix}
            rows, deep = fam.encode(model, m, whole)
            alone = [fam.encode(model, m, inputs([u])) for u in units]
        assert [r.shape[0] for r, _ in alone] == [u.n_tokens for u in units]  # the token rule
        assert rows.shape == (sum(u.n_tokens for u in units), spec.hidden) and len(deep) == spec.deepstack
        torch.testing.assert_close(torch.cat([r for r, _ in alone]), rows, rtol=1e-5, atol=1e-6)
        for j in range(spec.deepstack):
            torch.testing.assert_close(torch.cat([d[j] for _, d in alone]), deep[j], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ALL)
def test_mm_encoder_outputs_path_equals_pixel_path(family):
    """The hook's containers (`forward.VisionFeatures`, list / tensor) against the model's own merge."""
    from hf_longctx.integrations.vision.forward import VisionFeatures, _features

    model = build(family).eval()
    fam, spec = _spec_family(model)
    doc = mixed_documents(family)[2]  # images (and a video)
    ids = doc["input_ids"][None]
    kw = {k: v for k, v in doc.items() if k != "input_ids"}
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False, **kw, **_rope_kwargs(model, doc)).logits
        mm = {}
        for m in spec.modalities:
            if m.pixel_key not in doc:
                continue
            inp = {"pixels": doc[m.pixel_key]}
            if m.grid_key:
                inp["grid"] = doc[m.grid_key]
            rows, deep = fam.encode(model, m, inp)
            local = torch.cat([rows, *deep], dim=-1)  # [n, F] as the exchange delivers them
            idx = torch.arange(local.shape[0])
            mm[m.name] = VisionFeatures(
                pooler_output=_features(local, idx, 0, spec.hidden, spec),
                deepstack_features=[_features(local, idx, spec.hidden * (j + 1), spec.hidden, spec)
                                    for j in range(len(deep))] if deep else None)
        got = model(input_ids=ids, use_cache=False, mm_encoder_outputs=mm, **_rope_kwargs(model, doc)).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _rope_kwargs(model, doc) -> dict:
    """Explicit M-RoPE positions (the model's own rule) for the families that have one."""
    from hf_longctx.integrations.vision.families import _base

    base = _base(model)
    if not hasattr(base, "get_rope_index"):
        return {}
    ids = doc["input_ids"][None]
    mm = torch.zeros_like(ids)
    mm[ids == 150], mm[ids == 151] = 1, 2
    pos, _ = base.get_rope_index(ids, mm, doc.get("image_grid_thw"), doc.get("video_grid_thw"))
    return {"position_ids": torch.cat([torch.arange(ids.shape[1])[None, None], pos])}  # [4, 1, L]


@pytest.mark.parametrize("family", ["qwen3_vl", "gemma3"])
def test_zero_row_modality_keeps_the_graph(family):
    """A shard with no image token still gets its (zero-row) rows used by the model: the leaf
    they came from receives a gradient, so the exchange's backward runs on that rank."""
    from hf_longctx.integrations.vision.forward import VisionFeatures, _features

    model = build(family)
    _, spec = _spec_family(model)
    ids = mixed_documents(family)[1]["input_ids"][None]  # text only
    leaf = torch.zeros(0, spec.hidden * (1 + spec.deepstack), requires_grad=True)
    none = torch.zeros(0, dtype=torch.long)  # no row of this modality on this rank
    deep = [_features(leaf, none, spec.hidden * (j + 1), spec.hidden, spec) for j in range(spec.deepstack)] or None
    out = model(input_ids=ids, labels=ids, use_cache=False, **_rope_kwargs(model, {"input_ids": ids[0]}),
                mm_encoder_outputs={"image": VisionFeatures(pooler_output=_features(leaf, none, 0, spec.hidden, spec),
                                                            deepstack_features=deep)})
    out.loss.backward()
    assert leaf.grad is not None and leaf.grad.shape == (0, leaf.shape[1])


def test_patch_keeps_the_tower_attention_and_refuses_raw_pixels():
    from hf_longctx import init_sequence_parallel
    from hf_longctx.integrations.model_patch import patch, unpatch

    model = build("qwen2_5_vl")
    before = {type(c).__name__: c._attn_implementation for c in (model.config, model.config.text_config, model.config.vision_config)}
    patch(model, init_sequence_parallel())
    assert model.config.vision_config._attn_implementation == before["Qwen2_5_VLVisionConfig"]
    assert model.model.visual.config._attn_implementation == before["Qwen2_5_VLVisionConfig"]
    assert model.config.text_config._attn_implementation.startswith("hf_longctx_sp_")
    doc = mixed_documents("qwen2_5_vl")[0]
    with pytest.raises(ValueError, match="shard_multimodal"):
        model(input_ids=doc["input_ids"][None], pixel_values=doc["pixel_values"], image_grid_thw=doc["image_grid_thw"])
    unpatch(model)
    assert {type(c).__name__: c._attn_implementation for c in (model.config, model.config.text_config, model.config.vision_config)} == before


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "gemma3"])
def test_use_cache_false_reaches_the_language_model(family):
    """The wrappers take `use_cache` only through **kwargs, and their language model defaults it
    to `config.use_cache`: `takes_use_cache` says the patched forward's use_cache=False can be
    passed, and passed it keeps every decoder layer cache-free (a cache would hold every
    layer's K/V in training and grow with each row chunk of memory='max'); the default builds one."""
    from hf_longctx.integrations.forward_hooks import takes_use_cache
    from tests.helpers.vlm_cases import build

    model = build(family)
    assert takes_use_cache(model)
    seen = []
    layer = next(m for n, m in model.named_modules() if n.endswith("language_model.layers.0"))
    layer.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(kwargs.get("cache", kwargs.get("past_key_values"))), with_kwargs=True)
    ids = torch.randint(3, 100, (1, 12))
    model(input_ids=ids, use_cache=False)
    model(input_ids=ids)  # the config default, unpatched: the language model builds a cache
    assert seen[0] is None and seen[1] is not None, seen
