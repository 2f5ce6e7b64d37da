"""The classification table of image-text-to-text models: EXACT (with its adapter) or REFUSED (with the cause).

Where it sits: read by `registry.py`. One row per model type of transformers'
`MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`; `benchmarks/vlm_zoo.py` measures every EXACT
row (loss and every gradient against one process on packed rows with images) and
`tests/unit/test_vision_classification.py` checks that the table covers the installed
transformers. A cause names what breaks exactness (or what has no adapter yet), so the
user knows whether a setting, another class or no SP is the way forward.
"""

from __future__ import annotations

from hf_longctx.integrations.vision.families import BatchFamily, GridFamily

EXACT, REFUSED, UNCLASSIFIED = "EXACT", "REFUSED", "UNCLASSIFIED"

# Families whose images train exactly under SP (measured by benchmarks/vlm_zoo.py).
ADAPTERS = {
    "cohere_compass": GridFamily("cohere_compass"),
    "cosmos3_edge": GridFamily("cosmos3_edge"),
    "cosmos3_omni": GridFamily("cosmos3_omni"),
    "exaone4_5": GridFamily("exaone4_5"),
    "hyperclovax_vision_v2": GridFamily("hyperclovax_vision_v2"),
    "lfm3_vl": GridFamily("lfm3_vl"),
    "qwen2_vl": GridFamily("qwen2_vl"),
    "qwen2_5_vl": GridFamily("qwen2_5_vl"),
    "qwen3_vl": GridFamily("qwen3_vl"),
    "qwen3_vl_moe": GridFamily("qwen3_vl_moe"),
    "qwen3_5": GridFamily("qwen3_5"),
    "qwen3_5_moe": GridFamily("qwen3_5_moe"),
    "gemma3": BatchFamily("gemma3"),
    "shieldgemma2": BatchFamily("gemma3"),  # Gemma3ForConditionalGeneration under its own config type
    "llava": BatchFamily("llava"),
    "llava_onevision1_5": GridFamily("llava_onevision1_5"),
}

# Causes, shared by several rows (measured by benchmarks/vlm_zoo.py on tiny configs).
_ENC_DEC = "an encoder-decoder: the text decoder cross-attends to an encoder's states, not one causal sequence"
_CROSS = "cross-attention layers read the image states from every text position (a text shard would need every image key)"
_NO_PRE_ENCODED = (
    "its forward takes no pre-encoded image features (mm_encoder_outputs): images cannot be encoded on one rank and "
    "merged on another"
)
_NO_FEATURES = "no get_image_features: its image path cannot be called per image"


def _no_adapter(inputs: str) -> str:
    return f"no adapter for its image inputs ({inputs}): token count per image and encoder call not modelled yet"


def _no_contract(why: str) -> str:
    return f"no adapter: {why}"


def _text_refused(why: str) -> str:
    return f"its language model is refused by patch(): {why}"


def _unbuilt(why: str) -> str:
    return f"not measured: no tiny model could be built to check it ({why})"


def _measured(why: str) -> str:
    return f"measured inexact on 2 ranks with the generic grid adapter ({why})"


REFUSALS: dict[str, str] = {
    'apertus1p5': _no_adapter('image_sizes, pixel_values'),
    'aria': _no_adapter('pixel_mask, pixel_values'),
    'aya_vision': _no_adapter('image_sizes, pixel_values'),
    'blip': _NO_PRE_ENCODED,
    'blip-2': _ENC_DEC,
    'chameleon': _unbuilt("AttributeError: 'NoneType' object has no attribute 'get'"),
    'cohere2_vision': _no_adapter('image_sizes, pixel_values'),
    'deepseek_ocr2': _unbuilt("TypeError: 'NoneType' object is not subscriptable"),
    'deepseek_vl': _NO_FEATURES,
    'deepseek_vl_hybrid': _NO_FEATURES,
    'diffusion_gemma': _ENC_DEC,
    'dots3_note': _NO_FEATURES,
    'emu3': _unbuilt("AttributeError: 'NoneType' object has no attribute 'get'"),
    'ernie4_5_vl_moe': _text_refused(
        'the dry run with sequence-parallel attention failed in Ernie4_5_VLMoeTextRotaryEmbedding '
        '(model.language_model.rotary_emb) with RuntimeError: stack expects each tensor to'
    ),
    'evolla': _NO_PRE_ENCODED,
    'fast_vlm': _unbuilt(
        'ImportError: TimmWrapperModel requires the timm library but it was not found in your '
        'environment. You can inst'
    ),
    'florence2': _ENC_DEC,
    'fuyu': _NO_FEATURES,
    'gemma3n': _unbuilt(
        'ImportError: TimmWrapperModel requires the timm library but it was not found in your '
        'environment. You can inst'
    ),
    'gemma4': _no_adapter('image_position_ids, pixel_values, pixel_values_videos'),
    'gemma4_unified': _text_refused(
        "the model's attention mask contains 'or-ed blockwise_overlay.<locals>.inner_mask (keys "
        "beyond the causal document mask)' (bidirectional blocks (e.g. image tokens)): seque"
    ),
    'git': _NO_PRE_ENCODED,
    'glm46v': _no_contract(
        'the Qwen-style grid contract does not fit its image inputs (ValueError: Video features and '
        'video tokens do not match, tokens: 16, features: 8)'
    ),
    'glm4v': _no_contract(
        'the Qwen-style grid contract does not fit its image inputs (ValueError: Video features and '
        'video tokens do not match, tokens: 16, features: 8)'
    ),
    'glm4v_moe': _text_refused(
        'the dry run with sequence-parallel attention failed in Glm4vMoeTextRotaryEmbedding '
        '(model.language_model.rotary_emb) with RuntimeError: split_with_sizes expects split_siz'
    ),
    'glm5_next': _text_refused(
        'Glm5NextTextLinearAttention (model.language_model.layers.0.self_attn, '
        'model.language_model.layers.1.self_attn, model.language_model.layers.2.self_attn) mixes '
        'information '
    ),
    'glm_ocr': _no_contract(
        'the Qwen-style grid contract does not fit its image inputs (ValueError: Video features and '
        'video tokens do not match, tokens: 16, features: 8)'
    ),
    'glmga': _no_contract(
        'the Qwen-style grid contract does not fit its image inputs (ValueError: Video features and '
        'video tokens do not match, tokens: 16, features: 8)'
    ),
    'got_ocr2': _text_refused(
        "GotOcr2ForConditionalGeneration, GotOcr2Model do not call attention through transformers' "
        'AttentionInterface, so its attention cannot be replaced by sequence-parallel att'
    ),
    'granite4_vision': _unbuilt("TypeError: object of type 'NoneType' has no len()"),
    'granite_docling': _no_adapter('pixel_attention_mask, pixel_values'),
    'hunyuan_vl': _no_contract(
        'the Qwen-style grid contract does not fit (ValueError: HunYuanVLModel.get_rope_index takes '
        "no ['video_grid_thw']: not the Qwen-VL position contract)"
    ),
    'hy_v4_vl': _text_refused(
        'HYV4VLIndexer in HYV4VLAttention is a sparse-attention indexer: it selects a global top-k of '
        'keys per query from the attention mask, which cannot be made exact on local s'
    ),
    'idefics': _CROSS,
    'idefics2': _no_adapter('pixel_attention_mask, pixel_values'),
    'idefics3': _no_adapter('pixel_attention_mask, pixel_values'),
    'inkling2': _text_refused(
        'the dry run with sequence-parallel attention failed in Inkling2BlockAttentionResidual '
        '(model.language_model.layers.4.attention_input) with RuntimeError: The size of tenso'
    ),
    'inkling2_loop': _text_refused(
        'the dry run with sequence-parallel attention failed in Inkling2LoopBlockAttentionResidual '
        '(model.language_model.layers.4.attention_input) with RuntimeError: The size of t'
    ),
    'inkling_mm_model': _unbuilt("ModuleNotFoundError: No module named 'scipy'"),
    'instructblip': _ENC_DEC,
    'instructblipvideo': _ENC_DEC,
    'internvl': _no_adapter('image_sizes, pixel_values'),
    'janus': _NO_FEATURES,
    'kimi_k25': _no_contract(
        "the Qwen-style grid contract does not fit (AttributeError: 'Kimi_K25VisionConfig' object has "
        "no attribute 'spatial_merge_size')"
    ),
    'kosmos-2': _NO_PRE_ENCODED,
    'kosmos-2.5': _NO_PRE_ENCODED,
    'lfm2_vl': _no_adapter('pixel_attention_mask, pixel_values'),
    'lighton_ocr': _no_adapter('image_sizes, pixel_values'),
    'llama4': _text_refused(
        'the dry run with sequence-parallel attention failed in Llama4ForConditionalGeneration '
        "(Llama4ForConditionalGeneration) with AttributeError: 'MoeCausalLMOutputWithPast' ob"
    ),
    'llava_next': _no_adapter('image_sizes, pixel_values'),
    'llava_next_video': _no_adapter('image_sizes, pixel_values, pixel_values_videos'),
    'llava_onevision': _text_refused(
        "Qwen2Attention passes 'logits_to_keep' to the attention function: an input the "
        'sequence-parallel attention does not apply; ignoring it would silently change the model. Su'
    ),
    'minicpm_ocr': _no_adapter('pixel_values, pixel_values_videos'),
    'minicpmv4_6': _no_adapter('pixel_values, pixel_values_videos'),
    'minicpmv4_7': _no_adapter('pixel_values, pixel_values_videos'),
    'minimax_m3_vl': _measured('loss rel 2.3e-06, grad 9.4e-04 (worst lm_head.weight)'),
    'mistral3': _no_adapter('image_sizes, pixel_values'),
    'mistral4': _NO_PRE_ENCODED,
    'mistral_large4': _text_refused(
        'MistralLarge4TextIndexer in MistralLarge4TextAttention is a sparse-attention indexer: it '
        'selects a global top-k of keys per query from the attention mask, which cannot be'
    ),
    'mllama': _CROSS,
    'molmo2': _no_adapter(
        'image_grids, image_num_crops, image_token_pooling, pixel_values, pixel_values_videos, '
        'video_grids'
    ),
    'muse_glimmer': _no_contract(
        "the Qwen-style grid contract does not fit (AttributeError: 'MuseGlimmerVisionConfig' object "
        "has no attribute 'spatial_merge_size')"
    ),
    'muse_spark': _no_contract(
        "the Qwen-style grid contract does not fit (AttributeError: 'MuseSparkVisionConfig' object "
        "has no attribute 'spatial_merge_size')"
    ),
    'nemotron_h_omni': _no_adapter('image_grid_hw, pixel_values, pixel_values_videos'),
    'ovis2': _no_adapter('pixel_values'),
    'ovis2_5': _no_contract(
        'its image merge writes an indicator embedding over visual boundary tokens counted against the '
        'images of the whole row; the Qwen-style grid inputs do not run the unpatched model (ValueError: '
        'Expected 1 visual boundary tokens with id 101, but found 0.)'
    ),
    'paddleocr_vl': _no_contract(
        'the Qwen-style grid contract does not fit its image inputs (ValueError: not enough values to '
        'unpack (expected 5, got 3))'
    ),
    'paligemma': _text_refused('GemmaAttention is not causal (is_causal=False)'),
    'perception_lm': _unbuilt(
        'ImportError: TimmWrapperModel requires the timm library but it was not found in your '
        'environment. You can inst'
    ),
    'pi0': _unbuilt("AttributeError: 'PI0Config' object has no attribute 'vocab_size'"),
    'pi05': _unbuilt("AttributeError: 'PI05Config' object has no attribute 'vocab_size'"),
    'pix2struct': _ENC_DEC,
    'pp_chart2table': _text_refused(
        "GotOcr2ForConditionalGeneration, GotOcr2Model do not call attention through transformers' "
        'AttentionInterface, so its attention cannot be replaced by sequence-parallel att'
    ),
    'pp_formulanet': _ENC_DEC,
    'qianfan_ocr': _no_adapter('image_sizes, pixel_values'),
    'qwen2_5_omni_thinker': _no_contract(
        'the Qwen-style grid contract does not fit (ValueError: '
        "Qwen2_5OmniThinkerForConditionalGeneration.get_rope_index takes no ['mm_token_type_ids']: "
        'not t'
    ),
    'qwen3_omni_moe_thinker': _no_contract(
        'the Qwen-style grid contract does not fit (ValueError: '
        "Qwen3OmniMoeThinkerForConditionalGeneration.get_rope_index takes no ['mm_token_type_ids']: "
        'not '
    ),
    'qwen4_exp': _text_refused(
        'Qwen4ExpTextQSAIndexer in Qwen4ExpTextQSAIndexer is a sparse-attention indexer: it selects a '
        'global top-k of keys per query from the attention mask, which cannot be made '
    ),
    'smolvlm': _no_adapter('pixel_attention_mask, pixel_values'),
    'step3p7': _text_refused(
        "the model's mask uses sliding window(s) [5] that never reach the attention function (it "
        'receives none), so the window would be dropped'
    ),
    't5gemma2': _ENC_DEC,
    'udop': _ENC_DEC,
    'unlimited_ocr': _text_refused(
        "the model's attention mask contains 'or-ed and_masks.<locals>.and_mask (keys beyond the "
        "causal document mask)': sequence-parallel attention applies only causal document m"
    ),
    'video_llama_3': _no_contract(
        "the Qwen-style grid contract does not fit (AttributeError: 'VideoLlama3VisionConfig' object "
        "has no attribute 'spatial_merge_size')"
    ),
    'video_llava': _no_adapter('pixel_values, pixel_values_images, pixel_values_videos'),
    'vipllava': _no_adapter('pixel_values'),
    'vision-encoder-decoder': _ENC_DEC,
}


def verdict(model_type: str, class_name: str = "") -> tuple[str, object]:
    """(EXACT, adapter) | (REFUSED, cause) | (UNCLASSIFIED, message) for a model type."""
    if model_type in ADAPTERS:
        return EXACT, ADAPTERS[model_type]
    if model_type in REFUSALS:
        return REFUSED, REFUSALS[model_type]
    return UNCLASSIFIED, (
        f"model type '{model_type}' ({class_name or '?'}) is not yet classified for images under sequence parallelism "
        "(no adapter has been measured exact for it)"
    )
