"""Supervised fine-tuning of a vision-language model with images and video under sequence parallelism.

Run on 4 CPU ranks (gloo; Ulysses 2 x ring 2), everything built here (no hub):
    accelerate launch --multi_gpu --num_processes 4 --mixed_precision no recipes/vlm_sft.py
or on GPUs with your own Qwen2.5-VL checkpoint and processor rows:
    accelerate launch --config_file accelerate_configs/gpu_1node_8.yaml recipes/vlm_sft.py --model PATH ...

By default it builds a tiny Qwen2.5-VL-style model from a config, a word-level tokenizer with
the family's vision tokens and an image processor (Qwen2-VL's PIL backend), makes synthetic
images of several sizes and short "videos", and trains with `LongContextTrainer`: each
document is one row of processor outputs (`input_ids` with the placeholders expanded,
`pixel_values` / `image_grid_thw`, `pixel_values_videos` / `video_grid_thw`); the multimodal
collator packs documents with their images, plans the step by language-model cost plus
encoder work, computes M-RoPE positions per document and shards them with the tokens; each
rank encodes its share of the images and video slices and the embeddings travel to the
ranks holding their tokens in one exchange. `--trl`: TRL's SFTTrainer on conversations with
images and the processor as `processing_class` (TRL's own vision collator processes each
example). `--lora`: LoRA on the language model, the vision tower and projector frozen.
Videos are synthetic patch rows in the processor's layout (Qwen's video processor needs
torchvision). It prints the loss of every step and the trained tokens per second.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling module, also under accelerate launch

from common import add_common_args, check_common_args, checkpointing, patch_kwargs, step_lines, trainer_kwargs  # noqa: E402

from hf_longctx import init_sequence_parallel, patch  # noqa: E402
from hf_longctx.training.launch import describe, init_distributed, run_rank  # noqa: E402

SPECIALS = ["<pad>", "<eos>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
WORDS = [f"w{i}" for i in range(100)] + ["user", "assistant"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {% if m['content'] is string %}{{ m['content'] }} "
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|> "
    "{% elif c['type'] == 'text' %}{{ c['text'] }} {% endif %}{% endfor %}{% endif %}<|im_end|> {% endfor %}"
)
PATCH_DIM = 3 * 2 * 2 * 2  # channels x temporal patch x patch x patch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="from_pretrained path (with its processor); default: a tiny model built here")
    p.add_argument("--docs", type=int, default=24, help="synthetic documents to make")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tokens-per-step", type=int, default=256, help="global tokens per optimizer step")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens of one micro-batch of one SP group")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--trl", action="store_true", help="TRL SFTTrainer on conversations with images")
    p.add_argument("--lora", action="store_true", help="LoRA on the language model; tower and projector frozen")
    p.add_argument("--output-dir", default="runs/vlm_sft")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a collective may block before all ranks stop")
    p.add_argument("--seed", type=int, default=0)
    add_common_args(p, ulysses=2, ring=2, mixed_precision="fp32")
    args = check_common_args(p, p.parse_args(argv))
    if args.tokenizer is not None and args.model is None:
        p.error("--tokenizer names the processor of --model; without --model the recipe builds its own model "
                "and processor; do instead: pass --model PATH (--tokenizer PATH for a processor saved apart)")
    return args


def image_processor_class():
    """Qwen2.5-VL's processor for images only (its video processor needs torchvision)."""
    from transformers import ProcessorMixin, Qwen2_5_VLProcessor

    class ImageQwenProcessor(Qwen2_5_VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageQwenProcessor


def build_processor():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                        additional_special_tokens=SPECIALS[2:])
    images = Qwen2VLImageProcessorPil(patch_size=2, merge_size=2, temporal_patch_size=2, min_pixels=16, max_pixels=1024)
    return image_processor_class()(image_processor=images, tokenizer=tokenizer, chat_template=TEMPLATE)


def build_model(processor, seed: int):
    """A tiny Qwen2.5-VL: 2 text layers (hidden 64, GQA 4/2, M-RoPE), a 2-block tower (window + full)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = processor.tokenizer
    ids = {k: tok.convert_tokens_to_ids(t) for k, t in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
           ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=8, fullatt_block_indexes=[1]),
        **ids,
    )
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config)


def _image(g: torch.Generator, h: int, w: int):
    import numpy as np
    from PIL import Image

    return Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy().astype(np.uint8))


def _text(g: torch.Generator, n: int) -> str:
    return " ".join(WORDS[i] for i in torch.randint(0, 100, (n,), generator=g).tolist())


def conversations(n: int, seed: int):
    """TRL's conversational format: `messages` with image slots, `images` (PIL, several sizes)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        k = i % 3  # 0, 1 or 2 images
        sizes = [(8, 8), (8, 16), (16, 12)][:k]
        content = [{"type": "image"} for _ in sizes] + [{"type": "text", "text": _text(g, 4 + i % 5)}]
        rows.append({"messages": [{"role": "user", "content": content},
                                  {"role": "assistant", "content": [{"type": "text", "text": _text(g, 6 + i % 7)}]}],
                     "images": [_image(g, h, w) for h, w in sizes]})
    return Dataset.from_list(rows)


def processor_rows(processor, n: int, seed: int):
    """One row of processor outputs per document: the conversations through the processor, and every
    third document a short video (t=2 slices of 4x4 patches) as synthetic patch rows."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed + 1)
    convo = conversations(n, seed)
    rows = []
    for i in range(n):
        ex = convo[i]
        text = processor.apply_chat_template(ex["messages"], tokenize=False)
        out = processor(text=[text], images=[ex["images"]] if ex["images"] else None, return_tensors="pt")
        ids = out["input_ids"][0]
        row = {"input_ids": ids.tolist(), "pixel_values": None, "image_grid_thw": None,
               "pixel_values_videos": None, "video_grid_thw": None}
        if "pixel_values" in out:
            row["pixel_values"], row["image_grid_thw"] = out["pixel_values"].tolist(), out["image_grid_thw"].tolist()
        if i % 3 == 2:  # a video after the conversation: <vision_start> 8 video tokens <vision_end>
            tok = processor.tokenizer
            video = [tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", *["<|video_pad|>"] * 8, "<|vision_end|>")]
            row["input_ids"] = row["input_ids"] + video + tok.convert_tokens_to_ids(_text(g, 3).split())
            row["pixel_values_videos"] = torch.randn(2 * 4 * 4, PATCH_DIM, generator=g).tolist()
            row["video_grid_thw"] = [[2, 4, 4]]
        rows.append(row)
    return Dataset.from_list(rows)


def main(argv=None) -> None:
    from transformers import TrainingArguments

    from hf_longctx import LongContextTrainer, LongContextTrainerMixin

    args = parse_args(argv)
    device = init_distributed(timeout_s=args.timeout)
    common = dict(output_dir=args.output_dir, max_steps=args.steps, learning_rate=args.lr, logging_steps=1,
                  max_grad_norm=1.0, save_strategy="no", seed=args.seed, bf16=args.mixed_precision == "bf16",
                  use_cpu=device.type == "cpu", report_to=[], disable_tqdm=True, include_num_input_tokens_seen=True)
    if args.trl:
        from trl import SFTConfig

        config = SFTConfig(**common, max_length=None, packing=False, padding_free=False, **checkpointing(False))
    else:
        config = TrainingArguments(**common)
    mesh = init_sequence_parallel(ulysses_degree=args.ulysses, ring_degree=args.ring, fpdt_chunks=args.fpdt_chunks)
    if config.process_index == 0:
        print(describe(mesh, device, param_offload=args.param_offload))
    if args.model:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        processor = AutoProcessor.from_pretrained(args.tokenizer or args.model)
        model = AutoModelForImageTextToText.from_pretrained(args.model)
    else:  # every rank builds the same tiny model from the same seed
        processor = build_processor()
        model = build_model(processor, args.seed)
    model = model.float()
    if args.lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=r".*language_model.*\.(q|k|v|o)_proj")
        model = get_peft_model(model, lora)  # the base model (tower and projector included) is frozen
    model = patch(model, mesh, **patch_kwargs(args))
    data = conversations(args.docs, args.seed) if args.trl else processor_rows(processor, args.docs, args.seed)
    kw = dict(model=model, args=config, train_dataset=data, processing_class=processor, mesh=mesh,
              max_tokens=args.max_tokens, tokens_per_step=args.tokens_per_step, **trainer_kwargs(args))
    if args.trl:
        from trl import SFTTrainer

        class LongSFTTrainer(LongContextTrainerMixin, SFTTrainer):
            """TRL's SFTTrainer with exact sequence-parallel training."""

        trainer = LongSFTTrainer(**kw)
    else:
        trainer = LongContextTrainer(**kw)
    trainer.add_callback(step_lines(args.output_dir, config.process_index, config.process_index == 0))
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    seconds = time.perf_counter() - start
    if config.process_index == 0:
        tokens = trainer.state.num_input_tokens_seen  # global: every rank's documents, image tokens included
        print(f"trained {trainer.state.global_step} steps, {tokens} tokens in {seconds:.1f} s: {tokens / seconds:.0f} tokens/s")


if __name__ == "__main__":
    run_rank(main)  # exits without interpreter finalisation (hf_longctx/training/launch.py)
